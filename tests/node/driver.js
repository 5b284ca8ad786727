// Drives Apache's RocketMQ 5 Node.js client (npm rocketmq-client-nodejs, unmodified) for
// tests/test_node_client.py. One JSON argument says what to do; the last stdout line is the
// JSON result (a message's body is `body` repeated `repeat` times: a command line cannot carry
// megabytes). Every run is bounded by its own `seconds` and exits by itself.
'use strict';

const fs = require('node:fs');
const {
  Producer, SimpleConsumer, PushConsumer, ConsumeResult, FilterExpression,
} = require('rocketmq-client-nodejs');

const args = JSON.parse(process.argv[2]);
// TLS (`ssl`: the CA comes from GRPC_DEFAULT_SSL_ROOTS_FILE_PATH) and signed requests
// (`accessKey`, `secretKey`), passed to every client.
const security = {
  sslEnabled: args.ssl === true,
  sessionCredentials: args.accessKey
    ? { accessKey: args.accessKey, accessSecret: args.secretKey }
    : undefined,
};
const started = Date.now();

// The client's default logger writes files under ~/logs; keep its warnings on stderr instead,
// where a failing test shows them.
const logger = {
  info() {},
  debug() {},
  warn(...a) { process.stderr.write(`WARN ${a.map(String).join(' ')}\n`); },
  error(...a) { process.stderr.write(`ERROR ${a.map(String).join(' ')}\n`); },
};

function view(m) {
  return {
    messageId: m.messageId,
    topic: m.topic,
    // Large bodies are reported by length: stdout is a pipe read in one piece.
    body: m.body.length <= 4096 ? m.body.toString('utf8') : null,
    bodyLength: m.body.length,
    tag: m.tag ?? null,
    keys: m.keys,
    messageGroup: m.messageGroup ?? null,
    properties: Object.fromEntries(m.properties),
    corrupted: m.corrupted === true,
    deliveryAttempt: m.deliveryAttempt ?? null,
    deliveryTimestamp: m.deliveryTimestamp ? m.deliveryTimestamp.getTime() : null,
    receivedAt: Date.now(),
    at: Date.now() - started,
  };
}

function filterOf(a) {
  if (a.sql) return new FilterExpression(a.sql, 2); // FilterType.SQL
  return a.tag ?? '*';
}

async function produce() {
  const producer = new Producer({ endpoints: args.endpoint, ...security, logger, requestTimeout: 10000 });
  await producer.startup();
  const out = [];
  try {
    for (const m of args.messages) {
      try {
        const receipt = await producer.send({
          topic: m.topic ?? args.topic,
          body: Buffer.from(m.body.repeat(m.repeat ?? 1), 'utf8'),
          tag: m.tag,
          keys: m.keys,
          messageGroup: m.messageGroup,
          properties: m.properties ? new Map(Object.entries(m.properties)) : undefined,
          deliveryTimestamp: m.deliveryMs ? new Date(m.deliveryMs) : undefined,
        });
        out.push({
          messageId: receipt.messageId,
          transactionId: receipt.transactionId,
          offset: Number(receipt.offset),
        });
      } catch (e) {
        out.push({ error: String(e && e.message ? e.message : e), code: e && e.code });
      }
    }
  } finally {
    await producer.shutdown();
  }
  return out;
}

// Transactional messages: each message's `end` is "commit", "rollback" or absent (left for the
// broker's check-back). The checker answers from `answers` (key -> "COMMIT" / "ROLLBACK"; anything
// else: unknown) and records what it was asked; runs `seconds` after the last send.
async function transact() {
  const RESOLUTION = { COMMIT: 1, ROLLBACK: 2 }; // apache.rocketmq.v2.TransactionResolution
  const asked = [];
  const producer = new Producer({
    endpoints: args.endpoint, ...security,
    topic: args.topic,
    logger,
    requestTimeout: 10000,
    checker: {
      async check(view) {
        const key = view.keys[0];
        asked.push(key);
        return RESOLUTION[(args.answers ?? {})[key]] ?? 0;
      },
    },
  });
  await producer.startup();
  const sent = [];
  try {
    for (const m of args.messages) {
      const txn = producer.beginTransaction();
      const receipt = await producer.send(
        { topic: args.topic, body: Buffer.from(m.body, 'utf8'), keys: m.keys }, txn,
      );
      sent.push({ messageId: receipt.messageId, transactionId: receipt.transactionId });
      if (m.end === 'commit') await txn.commit();
      if (m.end === 'rollback') await txn.rollback();
    }
    if (args.hang) {
      // Sent, not ended: say so, then wait for the test's SIGKILL.
      process.stdout.write(`${JSON.stringify({ sent })}\n`);
      await new Promise(() => {});
    }
    await new Promise(r => setTimeout(r, args.seconds * 1000));
  } finally {
    await producer.shutdown();
  }
  return { sent, asked };
}

// Receive until `want` messages are acked. A message whose `nack` property is set is, on its
// first delivery, made visible again after `nackMs` with changeInvisibleDuration instead.
// `stopAfterAcks`: after that many acks, stop once a received message was left unacked (the
// rest of the batch in which the limit was reached, or the next batch: `left`).
// `announce`: write a {"polling": n} line before each receive (a test kills the process then).
// `stopFile`: run until that file exists (a failover test), writing a {"got": body} line per
// ack, and counting acks the broker refused (the message comes again) in `ackErrors`.
async function simple() {
  const consumer = new SimpleConsumer({
    endpoints: args.endpoint, ...security,
    consumerGroup: args.group,
    subscriptions: new Map([ [ args.topic, filterOf(args) ] ]),
    awaitDuration: args.awaitMs ?? 2000,
    requestTimeout: 10000,
    logger,
  });
  await consumer.startup();
  const deliveries = [];
  const acked = new Set();
  const ackErrors = {};
  let polls = 0;
  const going = () => (args.stopFile
    ? !fs.existsSync(args.stopFile)
    : acked.size < args.want && Date.now() - started < args.seconds * 1000);
  try {
    while (going()) {
      if (deliveries.some(d => d.left)) break;
      let messages = [];
      if (args.announce) process.stdout.write(`${JSON.stringify({ polling: ++polls })}\n`);
      try {
        messages = await consumer.receive(args.batch ?? 16, args.invisibleMs ?? 20000);
      } catch (e) {
        if (args.stopFile) {
          // A member gone: receive again (the client routes to the next).
          await new Promise(r => setTimeout(r, 200));
          continue;
        }
        if (!/no new message|MESSAGE_NOT_FOUND/i.test(String(e))) throw e;
      }
      for (const m of messages) {
        const v = view(m);
        deliveries.push(v);
        if (args.stopAfterAcks !== undefined && acked.size >= args.stopAfterAcks) {
          v.left = true;
        } else if (v.properties.nack && (m.deliveryAttempt ?? 1) === 1) {
          await consumer.changeInvisibleDuration(m, args.nackMs ?? 2000);
        } else if (args.stopFile) {
          try {
            await consumer.ack(m);
            acked.add(m.messageId);
            process.stdout.write(`${JSON.stringify({ got: v.body })}\n`);
          } catch (e) {
            const what = String(e && e.message ? e.message : e).slice(0, 120);
            ackErrors[what] = (ackErrors[what] ?? 0) + 1;
          }
        } else {
          await consumer.ack(m);
          acked.add(m.messageId);
        }
      }
    }
  } finally {
    await consumer.shutdown();
  }
  return args.stopFile ? { ackErrors, received: deliveries.length } : deliveries;
}

// A PushConsumer whose listener fails the first `failTimes` deliveries of every message with
// the property `fail` set; runs until `want` messages succeeded or `seconds` passed.
async function push() {
  const deliveries = [];
  const succeeded = new Set();
  const consumer = new PushConsumer({
    endpoints: args.endpoint, ...security,
    consumerGroup: args.group,
    subscriptions: new Map([ [ args.topic, filterOf(args) ] ]),
    requestTimeout: 10000,
    logger,
    messageListener: {
      async consume(m) {
        const v = view(m);
        deliveries.push(v);
        const failedBefore = deliveries.filter(d => d.messageId === v.messageId).length - 1;
        if (v.properties.fail && failedBefore < (args.failTimes ?? 1)) {
          return ConsumeResult.FAILURE;
        }
        succeeded.add(v.messageId);
        return ConsumeResult.SUCCESS;
      },
    },
  });
  await consumer.startup();
  try {
    while (succeeded.size < args.want && Date.now() - started < args.seconds * 1000) {
      await new Promise(r => setTimeout(r, 100));
    }
    // Let acks reach the broker before the consumer goes away.
    await new Promise(r => setTimeout(r, 500));
  } finally {
    await consumer.shutdown();
  }
  return deliveries;
}

// Send `key-<n>` for n = 0, 1, ... one at a time until `stopFile` exists, through whatever
// fails (a failover), writing an {"acked": n} line per acknowledgement; returns each
// acknowledged n with when (ms since the epoch), the n whose sends failed, and the errors.
async function produceFor() {
  const producer = new Producer({
    endpoints: args.endpoint, ...security, topic: args.topic, logger, requestTimeout: 5000,
  });
  await producer.startup();
  const acked = [];
  const failed = [];
  const errors = {};
  try {
    for (let n = 0; !fs.existsSync(args.stopFile); n++) {
      try {
        await producer.send({
          topic: args.topic, body: Buffer.from(`body-${n}`, 'utf8'), keys: [ `key-${n}` ],
        });
        acked.push([ n, Date.now() ]);
        process.stdout.write(`${JSON.stringify({ acked: n })}\n`);
      } catch (e) {
        const what = String(e && e.message ? e.message : e).slice(0, 120);
        errors[what] = (errors[what] ?? 0) + 1;
        failed.push(n);
        await new Promise(r => setTimeout(r, 50));
      }
    }
  } finally {
    await producer.shutdown();
  }
  return { acked, failed, errors };
}

const commands = { produce, simple, push, transact, produceFor };

commands[args.cmd]()
  .then(result => {
    process.stdout.write(`${JSON.stringify(result)}\n`, () => process.exit(0));
  })
  .catch(e => {
    process.stdout.write(`${JSON.stringify({ fatal: String(e && e.stack ? e.stack : e) })}\n`);
    process.exit(1);
  });
