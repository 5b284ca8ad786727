"""Builds the record engine's native inner loops; everything else is in pyproject.toml.

``pip install -e .`` (or a wheel build) compiles ``tiered/_record_native.pyx`` with Cython, which
``[build-system] requires`` brings. If the compiler fails, the package still installs and
``tiered.record`` falls back to its pure-Python reference (decision 150): set
``TMQ_REQUIRE_NATIVE=1`` to make a failed build an error instead.

Two build flags for hunting memory errors on hostile bytes (decision 766); a plain
``pip install -e .`` sets neither and builds what it always built:

- ``TMQ_NATIVE_CHECKED=1`` compiles copies of the ``.pyx`` files (under ``build/checked/``) whose
  header turns ``boundscheck`` and ``initializedcheck`` on: every typed index is checked, and
  with ``wraparound`` still off a negative index is an ``IndexError`` instead of a read from
  the end. (A module's header comment overrides Cython's command-line directives, hence the
  copies.)
- ``TMQ_NATIVE_SANITIZE=address`` (or ``address,undefined``) compiles and links with
  ``-fsanitize=...``: run it under ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)
  PYTHONMALLOC=malloc ASAN_OPTIONS=detect_leaks=0`` (docs/fuzzing.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A build failure leaves the reference implementation in charge, with a warning. The
    extensions compile side by side (one job per core, unless ``-j`` says otherwise): each is
    one C file, the record engine's the largest, and a fresh clone's install (CI's, and the
    README test's) otherwise waits for them one after the other. They compile without debug
    information (``-g0`` after Python's own ``-g``): it adds nothing at run time and costs 40% of
    the record engine's compile, the longest of the four (decision 572)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = True  # distutils: one job per core

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:
            if os.environ.get("TMQ_REQUIRE_NATIVE"):
                raise
            print(f"WARNING: tmq's native record engine was not built ({e}); using pure Python")

    def build_extension(self, ext: Extension) -> None:
        if SANITIZE:
            # Debug information and frame pointers for the reports; -O1 keeps them readable.
            flags = [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-g", "-O1"]
            args = [a for a in ext.extra_compile_args or [] if a != "-O3"]
            ext.extra_compile_args = [*args, *flags]
            ext.extra_link_args = [*(ext.extra_link_args or []), f"-fsanitize={SANITIZE}"]
        else:
            ext.extra_compile_args = [*(ext.extra_compile_args or []), "-g0"]
        try:
            super().build_extension(ext)
        except Exception as e:
            if os.environ.get("TMQ_REQUIRE_NATIVE"):
                raise
            print(f"WARNING: {ext.name} was not built ({e}); using pure Python")


extensions = [
    Extension(
        "tiered._record_native",
        ["tiered/_record_native.pyx"],
        depends=["tiered/_record_native.h"],
        extra_compile_args=["-O3"],
    ),
    # Group commit's batch gate: writers sleep without the GIL (decision 420).
    Extension(
        "tiered.hot._group_commit_native",
        ["tiered/hot/_group_commit_native.pyx"],
        extra_compile_args=["-O3"],
    ),
    # SendMessageRequest bytes to store Messages (decision 310); sets the slots as the engine
    # reads them, with the engine's header.
    Extension(
        "broker._send_native",
        ["broker/_send_native.pyx"],
        depends=["tiered/_record_native.h"],
        include_dirs=["tiered"],
        libraries=["z"],  # zlib's crc32 for a message group's queue, as the reference's
        extra_compile_args=["-O3"],
    ),
    # Stored messages to PullMessageResponse bytes in the cold worker (decision 400).
    # Records to PullMessageResponse bytes in the cold worker (decisions 400, 481), with the body
    # digest by the MD5 beside it.
    Extension(
        "broker._reply_native",
        ["broker/_reply_native.pyx"],
        depends=["broker/_md5.h", "broker/_md5_mb.h"],
        include_dirs=["broker"],
        extra_compile_args=["-O3"],
    ),
]

SANITIZE = os.environ.get("TMQ_NATIVE_SANITIZE", "")
if SANITIZE and not re.fullmatch(r"[a-z]+(,[a-z]+)*", SANITIZE):
    raise SystemExit(f"TMQ_NATIVE_SANITIZE={SANITIZE!r}: expected address or address,undefined")


def _checked(ext: Extension) -> Extension:
    """``ext`` built from a copy of its ``.pyx`` with bounds checks on (``TMQ_NATIVE_CHECKED``)."""
    (source,) = ext.sources
    text = Path(source).read_text()
    header, rest = text.split("\n", 1)
    header = header.replace("boundscheck=False", "boundscheck=True")
    header = header.replace("initializedcheck=False", "initializedcheck=True")
    if "boundscheck=True" not in header:
        raise SystemExit(f"{source}: no boundscheck directive in its first line to turn on")
    copy = Path("build", "checked", source)
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(f"{header}\n{rest}")
    ext.sources = [str(copy)]
    # The copy's C file includes the headers beside the original.
    ext.include_dirs = [*ext.include_dirs, str(Path(source).parent)]
    return ext


if os.environ.get("TMQ_NATIVE_CHECKED", "") not in ("", "0"):
    extensions = [_checked(ext) for ext in extensions]

setup(
    ext_modules=cythonize(extensions, language_level=3, quiet=True),
    cmdclass={"build_ext": OptionalBuildExt},
)
