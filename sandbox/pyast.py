"""`ast.parse` and `compile` of an AST, safe to call from several threads at once.

CPython keeps one AST-conversion recursion counter per interpreter; on 3.11 two threads converting at
the same time (one thread's conversion can let another run, e.g. through the garbage collector) leave it
inconsistent and the call fails with `SystemError: AST constructor recursion depth mismatch`
(python/cpython#106905). Our graders parse test code from thread pools (`verify_program` per problem,
reward functions, tool calls of agentic episodes), so every conversion goes through this one lock.
Compiling source text (not an AST) does not convert and needs no lock.
"""

from __future__ import annotations

import ast
import threading
from types import CodeType

_CONVERSION = threading.Lock()


def parse(source: str, filename: str = "<unknown>", mode: str = "exec") -> ast.AST:
    """`ast.parse(source, filename, mode)` under the conversion lock."""
    with _CONVERSION:
        return ast.parse(source, filename, mode)


def compile_tree(tree: ast.AST, filename: str, mode: str = "exec") -> CodeType:
    """`compile(tree, filename, mode)` of an AST under the conversion lock."""
    with _CONVERSION:
        return compile(tree, filename, mode)
