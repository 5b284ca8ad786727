"""SQL92 filters on message properties: RocketMQ's subset (``rocketmq-filter``).

A consumer subscribes with an expression such as
``region = 'eu' AND (price BETWEEN 10 AND 20 OR vip IS NOT NULL)``; the broker delivers only
the messages whose properties make it TRUE. What the subset has:

- literals: strings in single quotes (``''`` escapes a quote), integers, decimals, ``TRUE``,
  ``FALSE``, ``NULL``; identifiers name properties (user properties, and the system ones the
  record keeps: ``TAGS``, ``KEYS``);
- ``=``, ``<>``, ``>``, ``>=``, ``<``, ``<=``; ``[NOT] BETWEEN x AND y`` (numbers);
  ``[NOT] IN ('a', 'b')`` (strings); ``IS [NOT] NULL``; ``[NOT] CONTAINS | STARTSWITH |
  ENDSWITH 'text'`` (RocketMQ 5); ``AND``, ``OR``, ``NOT`` and parentheses. Keywords are
  case-insensitive.

Comparisons follow SQL's three-valued logic, as RocketMQ's evaluator does: a missing property,
or a property that is not a number compared with a number, makes the comparison unknown, and a
message is delivered only when the whole expression is TRUE. Property values are strings on the
wire; compared with a number literal they are read as numbers.

An expression is parsed once (lark, LALR) into a tree of closures and cached; nothing is ever
``eval``-ed. A malformed expression raises ``ValueError`` with where it went wrong, which the
broker answers with ILLEGAL_FILTER_EXPRESSION, as RocketMQ does.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from typing import Any

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import LarkError, UnexpectedInput, VisitError

from tiered.record import StoredMessage

# None is SQL's UNKNOWN.
Truth = bool | None
Props = Mapping[str, str]
Predicate = Callable[[Props], Truth]
Operand = Callable[[Props], Any]

_GRAMMAR = r"""
?start: or_expr
?or_expr: and_expr | or_expr _OR and_expr -> or_
?and_expr: not_expr | and_expr _AND not_expr -> and_
?not_expr: predicate | _NOT not_expr -> not_
?predicate: operand COMPARE operand -> compare
    | operand _BETWEEN operand _AND operand -> between
    | operand _NOT _BETWEEN operand _AND operand -> not_between
    | operand _IN "(" literal ("," literal)* ")" -> in_
    | operand _NOT _IN "(" literal ("," literal)* ")" -> not_in
    | operand _IS _NULL -> is_null
    | operand _IS _NOT _NULL -> is_not_null
    | operand TEXT_OP operand -> text
    | operand _NOT TEXT_OP operand -> not_text
    | boolean
    | "(" or_expr ")"
?operand: literal | IDENT -> prop
?literal: STRING -> string
    | NUMBER -> number
    | boolean
    | _NULL -> null
boolean: TRUE | FALSE

COMPARE: "<>" | ">=" | "<=" | "=" | ">" | "<"
TEXT_OP.2: /(CONTAINS|STARTSWITH|ENDSWITH)\b/i
_AND.2: /AND\b/i
_OR.2: /OR\b/i
_NOT.2: /NOT\b/i
_BETWEEN.2: /BETWEEN\b/i
_IN.2: /IN\b/i
_IS.2: /IS\b/i
_NULL.2: /NULL\b/i
TRUE.2: /TRUE\b/i
FALSE.2: /FALSE\b/i
IDENT: /[A-Za-z_$][A-Za-z0-9_$.\-]*/
STRING: /'([^']|'')*'/
NUMBER: /-?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?/

%import common.WS
%ignore WS
"""

_PARSER = Lark(_GRAMMAR, parser="lalr", maybe_placeholders=False)

_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "=": operator.eq,
    "<>": operator.ne,
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}
_TEXT: dict[str, Callable[[str, str], bool]] = {
    "CONTAINS": lambda a, b: b in a,
    "STARTSWITH": str.startswith,
    "ENDSWITH": str.endswith,
}


class _Literal:
    """A constant operand, kept apart from properties so the tree can check types."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self, props: Props) -> Any:
        return self.value


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _pair(left: Any, right: Any) -> tuple[Any, Any] | None:
    """The two sides made comparable, or None (UNKNOWN): a NULL side, a string that is not a
    number against a number, a boolean against anything but a boolean or 'true'/'false'."""
    if left is None or right is None:
        return None
    if isinstance(left, bool) or isinstance(right, bool):
        pair = [v if isinstance(v, bool) else {"true": True, "false": False}.get(str(v).lower())
                for v in (left, right)]  # fmt: skip
        return None if None in pair else (pair[0], pair[1])
    if isinstance(left, float) or isinstance(right, float):
        a = left if isinstance(left, float) else _number(left)
        b = right if isinstance(right, float) else _number(right)
        return None if a is None or b is None else (a, b)
    return left, right


@v_args(inline=True)
class _Compile(Transformer[Token, Predicate]):
    """Parse tree -> closures over a message's properties."""

    def string(self, token: Token) -> _Literal:
        return _Literal(str(token)[1:-1].replace("''", "'"))

    def number(self, token: Token) -> _Literal:
        return _Literal(float(token))

    def boolean(self, token: Token) -> _Literal:
        return _Literal(token.upper() == "TRUE")

    def null(self) -> _Literal:
        return _Literal(None)

    def prop(self, token: Token) -> Operand:
        name = str(token)
        return lambda props: props.get(name)

    def compare(self, left: Operand, op: Token, right: Operand) -> Predicate:
        test = _COMPARE[str(op)]
        if op not in ("=", "<>") and any(
            isinstance(side, _Literal) and isinstance(side.value, bool) for side in (left, right)
        ):
            raise ValueError(f"{op} does not apply to TRUE or FALSE")

        def run(props: Props) -> Truth:
            pair = _pair(left(props), right(props))
            if pair is None:
                return None
            try:
                return bool(test(*pair))
            except TypeError:  # a boolean ordered against a number
                return None

        return run

    def between(self, value: Operand, low: Operand, high: Operand) -> Predicate:
        for bound in (low, high):
            if not (isinstance(bound, _Literal) and isinstance(bound.value, float)):
                raise ValueError("BETWEEN takes number literals")
        lo, hi = low.value, high.value  # type: ignore[attr-defined]

        def run(props: Props) -> Truth:
            raw = value(props)
            number = raw if isinstance(raw, float) else None if raw is None else _number(raw)
            return None if number is None else bool(lo <= number <= hi)

        return run

    def not_between(self, value: Operand, low: Operand, high: Operand) -> Predicate:
        return self.not_(self.between(value, low, high))

    def in_(self, value: Operand, *items: Operand) -> Predicate:
        if not all(isinstance(i, _Literal) and isinstance(i.value, str) for i in items):
            raise ValueError("IN takes string literals")
        choices = frozenset(i.value for i in items)  # type: ignore[attr-defined]

        def run(props: Props) -> Truth:
            raw = value(props)
            return None if raw is None else raw in choices

        return run

    def not_in(self, value: Operand, *items: Operand) -> Predicate:
        return self.not_(self.in_(value, *items))

    def is_null(self, value: Operand) -> Predicate:
        return lambda props: value(props) is None

    def is_not_null(self, value: Operand) -> Predicate:
        return lambda props: value(props) is not None

    def text(self, value: Operand, op: Token, pattern: Operand) -> Predicate:
        if not (isinstance(pattern, _Literal) and isinstance(pattern.value, str)):
            raise ValueError(f"{op.upper()} takes a string literal")
        test, needle = _TEXT[op.upper()], pattern.value

        def run(props: Props) -> Truth:
            raw = value(props)
            return None if not isinstance(raw, str) else test(raw, needle)

        return run

    def not_text(self, value: Operand, op: Token, pattern: Operand) -> Predicate:
        return self.not_(self.text(value, op, pattern))

    def not_(self, inner: Predicate) -> Predicate:
        def run(props: Props) -> Truth:
            truth = inner(props)
            return None if truth is None else not truth

        return run

    def and_(self, left: Predicate, right: Predicate) -> Predicate:
        return _junction(left, right, decisive=False)

    def or_(self, left: Predicate, right: Predicate) -> Predicate:
        return _junction(left, right, decisive=True)


def _junction(left: Predicate, right: Predicate, decisive: bool) -> Predicate:
    """AND (FALSE decides) or OR (TRUE decides) in three-valued logic: UNKNOWN unless one side
    decides or both agree on the other value."""

    def run(props: Props) -> Truth:
        a = left(props)
        if a is decisive:
            return decisive
        b = right(props)
        if b is decisive:
            return decisive
        return None if a is None or b is None else not decisive

    return run


@functools.lru_cache(maxsize=1024)
def compile_sql92(expression: str) -> Predicate:
    """The predicate of ``expression`` (cached: every ReceiveMessage carries it again).
    Raises ValueError for anything outside the subset."""
    if not expression.strip():
        raise ValueError("the SQL92 expression is empty")
    try:
        tree = _PARSER.parse(expression)
        compiled = _Compile().transform(tree)
    except UnexpectedInput as e:
        raise ValueError(f"illegal SQL92 expression at column {e.column}: {expression!r}") from None
    except VisitError as e:
        raise ValueError(f"illegal SQL92 expression {expression!r}: {e.orig_exc}") from None
    except LarkError as e:
        raise ValueError(f"illegal SQL92 expression {expression!r}: {e}") from None
    if isinstance(compiled, _Literal):  # a bare TRUE or FALSE
        constant = compiled.value
        if not isinstance(constant, bool):
            raise ValueError(f"illegal SQL92 expression {expression!r}: not a condition")
        return lambda props: constant
    return compiled


class SqlFilter:
    """A SQL92 subscription, with TagFilter's two questions: the ConsumeQueue's tag hash says
    nothing about properties, so every entry is read and the record itself decides."""

    def __init__(self, expression: str) -> None:
        self.expression = expression
        self._predicate = compile_sql92(expression)

    def code_matches(self, code: int) -> bool:
        return True

    def matches(self, msg: StoredMessage) -> bool:
        return self._predicate(msg.properties) is True
