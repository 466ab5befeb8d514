"""A fix for Triton's CPU interpreter (``TRITON_INTERPRET=1``) under NumPy >= 2.4, applied only on request.

Triton 3.6's interpreter turns a scalar kernel value into a Python int with ``int(handle.data)``, where the data
is a one-element array; NumPy 2.4 made that an error (deprecated since 1.25). Every kernel loop whose bounds are
run-time values (``for start in range(lo, hi, BLOCK_N)``, the attention kernel's prefix loop) then fails
inside the interpreter, never in compiled code. Rewriting those loops as ``while`` loops would dodge it, but a
compiled ``while`` loop is not software-pipelined, so the kernels keep their ``for`` loops and the interpreter is
patched instead, the way later Triton releases fixed it (``int(data.squeeze())``).

Nothing here runs at import; tests and benchmark dry-runs call :func:`patch_interpreter_index` once, before
launching kernels under the interpreter. Compiled kernels never touch this code.
"""

from __future__ import annotations

import inspect

# Marks our wrapper so that a second call does not wrap it again.
_MARK = "_lookahead_index_fix"


def _index(self) -> int:
    # One element, whatever its rank; a larger array still raises, as it should.
    return int(self.handle.data.squeeze())


def patch_interpreter_index() -> bool:
    """Makes the interpreter's ``tensor.__index__`` accept one-element arrays of any rank.

    Returns True when the patch is in place (now or from an earlier call), False when this Triton has no
    interpreter hook of the expected shape (then nothing is changed: a newer Triton needs no fix, and an
    unknown one is left alone rather than guessed at).
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return False
    if params[:2] != ["tensor", "scope"]:
        return False

    def patched(tensor, scope, *args, **kwargs):
        original(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", _index)

    setattr(patched, _MARK, True)
    interpreter._patch_lang_tensor = patched
    return True
