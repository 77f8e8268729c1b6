"""The sandbox's Python layer runs only code compiled from source in the sandbox (issue 54,
defect 1): `code.__new__` and `function.__new__` were denied, but `marshal.loads` built a code
object just as well (a crafted `LOAD_CONST` then read and wrote any address and emptied the
audit-hook list). Every route to a code object that the compiler did not make is refused at
the Python layer: marshal (loads, load, importlib's `_compile_bytecode`, `_imp`'s frozen
loader with data, a `.pyc` imported from the work dir or a zip, pickle through marshal), the
code type's constructor and `replace`, and a function's `__code__` swapped; a `.pyc` next to a
module's source is ignored (imports compile the source). Normal programs keep importing the
standard library."""

import asyncio

import pytest

from megatron_gspo.agent.tools.python_sandbox import PythonSandbox

ROUTES = r"""
import io, marshal, sys, types
src = compile("x = 1", "crafted", "exec")
ops = bytearray(src.co_code)
i = ops.index(100)  # LOAD_CONST
ops[i + 1] = 200  # far past co_consts: read/write of memory in a real exploit
bad = bytes(ops)
blob = marshal.dumps(src)
crafted = blob.replace(src.co_code, bad)
benign = marshal.dumps(compile("print('PYC RAN')", "pyc", "exec"))

def pyc(body):
    import importlib.util
    return importlib.util.MAGIC_NUMBER + b"\0" * 12 + body

def via_pickle():
    import copyreg, pickle
    copyreg.pickle(types.CodeType, lambda co: (marshal.loads, (crafted,)))
    return pickle.loads(pickle.dumps(src))

def via_pyc_import():
    with open("evil.pyc", "wb") as f:
        f.write(pyc(benign))
    sys.path.insert(0, ".")
    import evil
    return evil

def via_zip():
    import zipfile
    with zipfile.ZipFile("evil.zip", "w") as z:
        z.writestr("zevil.pyc", pyc(benign))
    sys.path.insert(0, "evil.zip")
    import zevil
    return zevil

def via_code_swap():
    def f():
        return 1
    f.__code__ = (lambda: 2).__code__
    return f

def via_frozen():
    import _imp
    return _imp.get_frozen_object("zz", crafted)

def via_compile_bytecode():
    import importlib._bootstrap_external as ext
    return ext._compile_bytecode(crafted)

routes = {
    "marshal.loads": lambda: marshal.loads(crafted),
    "marshal.load": lambda: marshal.load(io.BytesIO(crafted)),
    "CodeType": lambda: types.CodeType(
        src.co_argcount, src.co_posonlyargcount, src.co_kwonlyargcount, src.co_nlocals,
        src.co_stacksize, src.co_flags, bad, src.co_consts, src.co_names, src.co_varnames,
        src.co_filename, src.co_name, src.co_qualname, src.co_firstlineno, src.co_linetable,
        src.co_exceptiontable, src.co_freevars, src.co_cellvars),
    "replace": lambda: src.replace(co_code=bad),
    "pickle": via_pickle,
    "compile_bytecode": via_compile_bytecode,
    "frozen_data": via_frozen,
    "pyc_import": via_pyc_import,
    "zip_pyc": via_zip,
    "code_swap": via_code_swap,
}
for name, fn in routes.items():
    try:
        got = fn()
    except Exception as e:
        print(name, "refused" if "sandbox:" in str(e) else "error", type(e).__name__, e)
    else:
        print(name, "GOT", type(got).__name__)
    sys.stdout.flush()
"""


def _run(code, **kw):
    sb = PythonSandbox(cpu_seconds=5, wall_timeout_s=30, max_output_chars=20000, **kw)
    return asyncio.run(sb.run(code))


def test_every_route_to_a_code_object_not_compiled_here_is_refused():
    rc, out, err, _ = _run(ROUTES)
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.strip())
    assert rc == 0, (out, err)
    assert "PYC RAN" not in out, out
    assert not any(v.startswith("GOT") for v in lines.values()), out
    refused = {k for k, v in lines.items() if v.startswith("refused")}
    assert refused == {"marshal.loads", "marshal.load", "CodeType", "replace", "pickle",
                       "compile_bytecode", "pyc_import", "zip_pyc", "code_swap"}, out
    # `_imp` turns the hook's refusal of the unmarshal into "invalid frozen object"
    assert lines["frozen_data"].startswith("error ImportError"), out


def test_a_pyc_next_to_the_source_is_ignored():
    """A crafted __pycache__ entry with the source's exact mtime and size: the source runs."""
    code = r"""
import marshal, os, importlib.util, sys
with open("mod.py", "w") as f:
    f.write("print('SOURCE RAN')\n")
st = os.stat("mod.py")
os.mkdir("__pycache__")
with open(importlib.util.cache_from_source("mod.py") if sys.implementation.cache_tag
          else "__pycache__/mod.cpython-311.pyc", "wb") as f:
    f.write(importlib.util.MAGIC_NUMBER + b"\0\0\0\0"
            + int(st.st_mtime).to_bytes(4, "little") + st.st_size.to_bytes(4, "little")
            + marshal.dumps(compile("print('PYC RAN')", "pyc", "exec")))
sys.path.insert(0, ".")
import mod
"""
    rc, out, err, _ = _run(code)
    assert rc == 0, (out, err)
    assert out.split() == ["SOURCE", "RAN"], (out, err)


@pytest.mark.parametrize("modules", [
    "json, re, collections, math, itertools, functools, random, statistics, fractions",
    "csv, argparse, logging, difflib, html.parser, pprint, shlex, calendar, xml.dom.minidom",
    "zipfile, dataclasses, typing, decimal, datetime, enum, textwrap, heapq, string",
])
def test_standard_library_imports_still_work(modules):
    rc, out, err, _ = _run(f"import {modules}\nprint('ok', len({modules.split(',')[0]}.__name__))")
    assert rc == 0 and out.split()[0] == "ok", (out, err)
