"""The import environment of the GPU check: SGLang carried in, stubs, and a device simulation.

The H200 that runs ``check_backend.py`` has torch 2.11 + cu130, Triton 3.6, transformers 5.17 and
Python 3.12, but no SGLang and none of its GPU libraries (``sgl_kernel``, FlashInfer, flash-attn
cannot travel). ``make gpu-carry`` (``make_carry.py``) packs what is missing into ``.gpu-carry/``:

- ``site.zip``: SGLang 0.5.23's Python sources (trimmed) and the pure-Python packages it imports
  that the device lacks, laid out like ``site-packages``;
- ``wheels/``: cp312 manylinux wheels of the compiled packages it imports (msgspec, pyzmq, ...);
- ``MANIFEST.json``: what is in it, and the import names each package provides.

``activate()`` runs before anything imports SGLang, in the check and in every stage subprocess:

1. it unpacks the carry once into a cache folder (``$SGLANG_HYBRID_CARRY_CACHE`` or
   ``/tmp/sglang-hybrid-carry/<digest>``; the wheels only where their Python tag matches) and
   puts it first on ``sys.path``, then this repository's ``python/``;
2. where CUDA is present (or faked), it stubs the modules named in ``STUBS`` that cannot be
   imported for real: SGLang imports ``sgl_kernel`` at import time wherever CUDA is present.
   A stub module hands out placeholders: touching them while importing works
   (``from sgl_kernel import rmsnorm``, decorators, ``scalar_types.uint4b8``); calling one
   afterwards raises ``StubCalled`` naming it, so a code
   path that needs a stubbed kernel fails loudly instead of computing nothing. Every stubbed
   module and attribute is logged and reported (``report()``);
3. ``simulate_device=True`` (the dry run and the CPU smoke mode, on this CPU machine) hides every
   third-party package that the device image does not have and the carry does not bring
   (``DEVICE_PACKAGES``, KINDS.md's list for ``nvidia-h200``), so a missing dependency fails here
   as it would there. The compiled packages the carry brings as cp312 wheels are taken from this
   venv's own builds of the same version.
4. ``fake_cuda=True`` (the dry run's import probe only) makes ``torch.cuda.is_available()`` and
   the device queries SGLang makes at import time answer like an H200, so the imports that only
   happen when CUDA is present run too. Nothing may compute under it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import types
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CARRY = ROOT / ".gpu-carry"
log = logging.getLogger("gpu_env")

# Modules that never travel; stubbed only when they cannot be imported for real.
STUBS = ("sgl_kernel",)

# Import names of the Python packages on the nvidia-h200 image (/work/.library/device/KINDS.md,
# "Python packages already there", read 2026-11-17), plus the ones those packages install under
# other names. What is not here and not in the carry is hidden by ``simulate_device``.
_DEVICE_PACKAGE_NAMES = """
    absl accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attr attrs
    botorch build certifi charset_normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda cuda_bindings cuda_core cuda_pathfinder cupy cupy_backends cupyx cycler Cython
    cython pyximport diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fontTools
    formulaic frozenlist fsspec gpytorch grpc h11 h5py hf_xet httpcore httpx huggingface_hub
    humanize hypothesis _hypothesis_pytestplugin idna imageio iniconfig interface_meta jax
    jax_plugins jaxlib jaxtyping jinja2 joblib kiwisolver lazy_loader lightning
    lightning_utilities linear_operator lineax llvmlite lxml markdown markdown_it markupsafe
    matplotlib mpl_toolkits pylab mdurl mesonpy ml_dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy_extensions nanobind narwhals networkx ninja numba numba_cuda numpy
    numpyro nvidia pynvml onnx onnx_ir onnxruntime onnxscript cv2 optax opt_einsum opt_einsum_fx
    optimistix orbax packaging pandas pathspec patsy peft PIL pip pluggy portalocker
    prometheus_client propcache psutil pyarrow pybind11 cpuinfo pygments pyparsing
    pyproject_hooks pyre_extensions pytest _pytest py pytest_benchmark pytest_cov pytest_mock
    pytest_timeout xdist dateutil pytorch_lightning yaml _yaml regex requests rich sacrebleu
    safetensors scikit_build_core skimage sklearn scipy seaborn sentencepiece
    sentence_transformers setuptools pkg_resources _distutils_hack shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard_data_server tensorstore
    threadpoolctl tifffile tiktoken timm tokenizers toolz tlz torch torchgen functorch torchaudio
    torchdiffeq torch_geometric torchmetrics torchvision tqdm transformers treescope triton typer
    typing_extensions typing_inspect urllib3 uvloop wadler_lindig werkzeug wheel wrapt xarray
    xxhash yarl zipp google isympy
"""
DEVICE_PACKAGES = frozenset(_DEVICE_PACKAGE_NAMES.split())
# Ours: always importable (the working tree travels).
OWN = frozenset({"sglang_hybrid", "checking_worker", "direct", "programs", "conftest"})

_STATE: dict[str, Any] = {"stubbed": {}, "stub_calls": [], "carry": None}


class StubCalled(RuntimeError):
    """A stubbed module's function was called after imports: the code path needs a kernel that
    cannot travel to the device."""


class _Placeholder:
    """What a stub module hands out: anything at import time, an error when used afterwards."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _STATE.get("importing", True):
            return _Placeholder(f"{self._name}()")
        _STATE["stub_calls"].append(self._name)
        raise StubCalled(f"{self._name} is stubbed (it cannot travel to the device) and was called")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __getitem__(self, key: Any) -> Any:
        return _Placeholder(f"{self._name}[]")

    def __or__(self, other: Any) -> Any:
        return _Placeholder(f"{self._name}|")

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        names = _STATE["stubbed"].setdefault(self.__name__, set())
        if attr not in names:
            names.add(attr)
            log.info("stub: %s.%s", self.__name__, attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: answers only for STUBS nobody else could import."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__file__ = f"<stub {spec.name}>"
        if spec.name not in _STATE["stubbed"]:
            _STATE["stubbed"][spec.name] = set()
            log.warning("stub module %s (cannot travel to the device)", spec.name)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def device_view(allowed: Iterable[str], cache: Path | None = None) -> Path:
    """A copy of this venv's ``site-packages`` as the device would see it: symbolic links to
    the packages (and their ``.dist-info``) the device has or the carry brings, nothing else.

    Put in place of ``site-packages`` on ``sys.path`` it makes every other package absent, for
    imports and for availability probes (``importlib.util.find_spec``) alike.
    """
    import sysconfig

    ok = frozenset(allowed) | DEVICE_PACKAGES | OWN
    site = Path(sysconfig.get_paths()["purelib"])
    key = hashlib.sha256(("\n".join(sorted(ok)) + str(site)).encode()).hexdigest()[:12]
    base = cache or Path(os.environ.get("SGLANG_HYBRID_CARRY_CACHE", "/tmp/sglang-hybrid-carry"))
    view = base / f"device-view-{key}"
    if (view / ".complete").exists():
        return view
    view.mkdir(parents=True, exist_ok=True)
    # A distribution is there whole or not at all: all its top-level names follow the first.
    kept_dists = set()
    for entry in site.iterdir():
        if entry.name.endswith(".dist-info"):
            tops = _dist_tops(entry)
            if tops and any(t in ok for t in tops):
                kept_dists.add(entry.name)
                ok = ok | tops
    for entry in site.iterdir():
        name = entry.name
        if name.endswith(".dist-info"):
            keep = name in kept_dists
        elif name.endswith((".pth", ".egg-link")) or name == "__pycache__":
            keep = False
        else:
            top = name.split(".")[0]
            keep = top in ok
        if keep and not (view / name).exists():
            (view / name).symlink_to(entry)
    (view / ".complete").write_text("")
    return view


def _dist_tops(dist_info: Path) -> set[str]:
    tops = set()
    record = dist_info / "RECORD"
    if record.exists():
        for line in record.read_text().splitlines():
            first = line.split(",")[0].split("/")[0]
            if (
                first.endswith((".dist-info", ".data"))
                or first in ("..", "")
                or first.startswith("__")
            ):
                continue
            tops.add(first[:-3] if first.endswith(".py") else first.split(".")[0])
    return tops


def _use_device_view(view: Path) -> None:
    import sysconfig

    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != site]
    sys.path.append(str(view))
    importlib.invalidate_caches()


def read_manifest(carry: Path) -> dict[str, Any] | None:
    path = carry / "MANIFEST.json"
    return json.loads(path.read_text()) if path.exists() else None


def carried_top_levels(manifest: dict[str, Any] | None) -> set[str]:
    if manifest is None:
        return set()
    return {t for pkg in manifest["packages"].values() for t in pkg["top_level"]}


def _wheel_matches(name: str) -> bool:
    """Whether this interpreter loads the wheel (the carry's are cp312: the device's Python)."""
    return f"-cp{sys.version_info.major}{sys.version_info.minor}-" in name


def unpack(carry: Path, cache: Path | None = None) -> Path:
    """Unpack ``site.zip`` and the matching wheels once; return the site folder."""
    digest = hashlib.sha256((carry / "MANIFEST.json").read_bytes()).hexdigest()[:12]
    base = cache or Path(os.environ.get("SGLANG_HYBRID_CARRY_CACHE", "/tmp/sglang-hybrid-carry"))
    site = base / digest / f"site-py{sys.version_info.major}{sys.version_info.minor}"
    done = site / ".complete"
    if done.exists():
        return site
    site.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(carry / "site.zip") as z:
        z.extractall(site)
    for wheel in sorted((carry / "wheels").glob("*.whl")):
        if _wheel_matches(wheel.name):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
    done.write_text(digest)
    return site


def activate(
    carry: Path | None = None,
    *,
    simulate_device: bool = False,
    fake_cuda: bool = False,
) -> dict[str, Any]:
    """Prepare imports (see the module docstring); returns what was done."""
    info: dict[str, Any] = {"python": sys.version.split()[0], "carry": None}
    manifest = read_manifest(carry) if carry is not None else None
    if manifest is not None:
        assert carry is not None
        site = unpack(carry)
        sys.path.insert(0, str(site))
        info["carry"] = {"path": str(carry), "site": str(site), "sglang": manifest["sglang"]}
        wheel_tops = {
            t
            for pkg in manifest["packages"].values()
            if pkg["kind"] == "wheel"
            for t in pkg["top_level"]
        }
        if simulate_device and not any(_wheel_matches(w) for w in manifest.get("wheels", [])):
            # This Python cannot load the cp312 wheels: this venv's builds stand in for them.
            info["carry"]["compiled_from_venv"] = sorted(wheel_tops)
    _STATE["carry"] = info["carry"]
    for p in (ROOT / "python",):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    if simulate_device:
        view = device_view(carried_top_levels(manifest))
        _use_device_view(view)
        info["simulate_device"] = str(view)
    if fake_cuda:
        _fake_cuda()
        info["fake_cuda"] = True
    import torch

    if torch.cuda.is_available():  # SGLang imports sgl_kernel only where CUDA is present
        sys.meta_path.append(_StubFinder(STUBS))
        info["stubs"] = list(STUBS)
    _STATE["importing"] = True
    return info


def imports_done() -> None:
    """From here on a call into a stub raises ``StubCalled``."""
    _STATE["importing"] = False


@contextlib.contextmanager
def importing() -> Any:
    """Within the block, stub placeholders may be called (lazy imports, decorators)."""
    before = _STATE.get("importing", True)
    _STATE["importing"] = True
    try:
        yield
    finally:
        _STATE["importing"] = before


def report() -> dict[str, Any]:
    return {
        "stubbed": {k: sorted(v) for k, v in sorted(_STATE["stubbed"].items())},
        "stub_calls": list(_STATE["stub_calls"]),
        "carry": _STATE["carry"],
    }


def _fake_cuda() -> None:
    """CUDA present as far as SGLang's import-time checks look (never compute under this)."""
    from types import SimpleNamespace

    import torch

    props = SimpleNamespace(
        name="NVIDIA H200",
        major=9,
        minor=0,
        total_memory=141 << 30,
        multi_processor_count=132,
        L2_cache_size=60 << 20,
        warp_size=32,
        gcnArchName="",
    )
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.mem_get_info = lambda *a, **k: (130 << 30, 141 << 30)
