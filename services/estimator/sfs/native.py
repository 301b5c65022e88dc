"""The replay kernel compiled to C with mypyc, used when a build of this exact source exists.

`kernel.py` is plain, fully typed Python; mypyc (part of mypy) compiles it
unchanged into a C extension that runs the same code about twice as fast (the
SFS decision path, `just bench-sfs --parts 4`, prints which one ran). The build
lives in the cache directory under a key made of the interpreter's ABI tag and a
SHA-256 of kernel.py and mypy's version, so a stale build can never load: after an
edit the key changes and the plain module runs until the next build.

    python -m services.estimator.sfs build-native  # compile (./baton install does it)
    python -m services.estimator.sfs kernel        # which kernel loads, and why

`BATON_NATIVE=0` forces the plain module (to compare the two, or to debug).
Everything that replays takes the kernel from here: `IMPL` is the module to call
(its `build_state` makes a snapshot's state); annotations keep naming
`kernel.KernelState`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from services.estimator.sfs import kernel
from shared.config import Env
from shared.model_store import cache_path

MODULE_NAME = "baton_sfs_kernel"  # the compiled copy's top-level name
SOURCE = Path(kernel.__file__)


def source_key() -> str:
    """ABI tag + hash of kernel.py and the compiler's version: the build directory
    that matches this interpreter, this source and this mypyc exactly."""
    abi = sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}"
    try:
        compiler = importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        compiler = "none"
    digest = hashlib.sha256(SOURCE.read_bytes() + compiler.encode()).hexdigest()[:16]
    return f"{abi}-{digest}"


def build_dir() -> Path:
    return cache_path() / "native" / source_key()  # not created until a build


def _built_file(directory: Path) -> Path | None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    path = directory / f"{MODULE_NAME}{suffix}"
    return path if path.is_file() else None


def build(*, quiet: bool = True) -> Path:
    """Compile kernel.py with mypyc into build_dir(); returns the extension's path.

    Raises RuntimeError with the compiler's output when mypyc or a C compiler is
    missing or the build fails (the plain module keeps working either way).
    """
    target = build_dir()
    if (done := _built_file(target)) is not None:
        return done
    with tempfile.TemporaryDirectory(prefix="baton-native-") as tmp:
        src = Path(tmp) / f"{MODULE_NAME}.py"
        shutil.copyfile(SOURCE, src)
        proc = subprocess.run(
            [sys.executable, "-m", "mypyc", src.name],
            cwd=tmp,
            capture_output=quiet,
            text=True,
            check=False,
        )
        built = _built_file(Path(tmp))
        if proc.returncode != 0 or built is None:
            detail = (proc.stdout or "") + (proc.stderr or "") if quiet else ""
            raise RuntimeError(f"mypyc failed (exit {proc.returncode}): {detail[-2000:]}")
        target.mkdir(parents=True, exist_ok=True)
        # Copy to a file of our own, then rename: a process loading concurrently never
        # sees half a file, and two builds racing each install a whole one.
        with tempfile.NamedTemporaryFile(dir=target, suffix=".partial", delete=False) as f:
            partial = Path(f.name)
        shutil.copyfile(built, partial)
        partial.replace(target / built.name)
    done = _built_file(target)
    assert done is not None
    return done


def _load_built(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> tuple[ModuleType, str]:
    """The kernel module to run and a line saying which one and why."""
    if Env.NATIVE.get() == "0":
        return kernel, "plain Python (BATON_NATIVE=0)"
    try:
        path = _built_file(build_dir())
        if path is None:
            return kernel, "plain Python (no native build for this kernel.py: ./baton install)"
        return _load_built(path), f"native (mypyc) {path}"
    except (ImportError, OSError) as exc:  # a broken build, an unreadable cache: never fatal
        return kernel, f"plain Python (native build failed to load: {exc})"


IMPL, IMPL_NOTE = load()
NATIVE = IMPL is not kernel
