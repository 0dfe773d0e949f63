"""
The GPU machine's Python environment, simulated on this one: what runs there must run here first.

The lent H200 machine runs our code under its own image's Python packages, with no registry to install from. This
tool puts the library versions of that image ahead of the project's virtual environment and makes every package the
image lacks unimportable, so a test can run the device's commands (bench/device_check.py, experiments/paper/run.py
--stage device) exactly as far as the device would get:

    python -m bench.device_env build                    # download (once, cached in .cache/) and install the pins
    python -m bench.device_env run -- python -m bench.device_check --toy
    python -m bench.device_env check                    # what is pinned, what is blocked, seen from inside

How: `pip install --no-deps --target <dir>/site` of the PINS (the image's versions where they differ from ours:
transformers, huggingface_hub, sentence-transformers, tokenizers, accelerate), and <dir>/hook/sitecustomize.py, which
Python imports at start-up, swaps the path finder on sys.meta_path for one that does not look in the project's
site-packages for the packages the image lacks (imports fail with ModuleNotFoundError, importlib.util.find_spec gives
None and importlib.metadata finds no distribution, as on the device), while a copy carried and installed elsewhere
(the run's wheels in /tmp/site) is still found. torch stays this machine's (CPU) build.

The device's package list lives in ONE place, DEVICE_PACKAGES and PINS below (from the machine's image, read
2026-11-17): a newer list is one edit, and which of the project's installed packages are blocked follows from it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".cache" / "device_env"

# The versions the device's image holds where they differ from requirements.txt (its pip list, 2026-11).
PINS = {"transformers": "5.17.0", "huggingface_hub": "1.33.0", "sentence-transformers": "6.0.1",
        "tokenizers": "0.23.2", "accelerate": "1.15.0"}
# Packages of the device's image that the pins import and this environment lacks (huggingface_hub 1.x reads httpx,
# ours httpx2): installed beside the pins; their versions there were not read, so the latest.
SUPPLIED = {"httpx": None, "httpcore": None}
# Every Python distribution of the device's image (its package list, 2026-11-17). Any distribution installed in the
# project's environment and not named here is blocked inside the simulation.
DEVICE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
# What a device run carries as wheels (experiments/paper/device.py WHEELS; bench/device_wheels.sh for the check's
# end-to-end part): downloaded beside the pins so that the simulated run installs them as the device does.
CARRIED = {"datasets": "5.2.0", "dill": None, "multiprocess": None}


def norm(name: str) -> str:
    """A distribution's name as the package index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def host_site_dirs() -> list:
    """The project environment's site-packages (what the simulation hides packages from)."""
    return sorted({os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")})


def blocked() -> dict:
    """{distribution: [its top-level modules]} installed here and absent from the device (DEVICE_PACKAGES), plus the
    pinned ones (whose copies here must not be seen either: the pins in <dir>/site stand in for them)."""
    device = {norm(n) for n in DEVICE_PACKAGES}
    pinned = {norm(n) for n in PINS}
    out, kept = {}, set()
    for module, dists in md.packages_distributions().items():
        for d in dists:
            if norm(d) not in device or norm(d) in pinned:
                out.setdefault(norm(d), set()).add(module)
            else:
                kept.add(module)
    # a module some device package also provides (a namespace package: google, nvidia) stays visible
    out = {d: sorted(m for m in ms if m not in kept and not m.startswith("_")) for d, ms in out.items()}
    return {d: ms for d, ms in sorted(out.items()) if ms}


HOOK = '''"""Written by bench/device_env.py (do not edit): the device machine's missing packages made unimportable."""
import importlib.machinery as _m
import os as _os
import re as _re
import sys as _sys

_HOST = {host!r}
_DISTS = set({dists!r})
_MODULES = set({modules!r})


def _on_host(p):
    p = _os.path.realpath(str(p))
    return any(p == h or p.startswith(h + _os.sep) for h in _HOST)


class DeviceFinder(_m.PathFinder):
    """The path finder, blind to the blocked packages' copies in the project's site-packages."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None and name in _MODULES:  # a top-level import: look everywhere but the project's site-packages
            # (a folder inside them that is on sys.path stays: setuptools/_vendor, whose jaraco the device has too)
            return _m.PathFinder.find_spec(name, [p for p in _sys.path if _os.path.realpath(p or ".") not in _HOST],
                                           target)
        return _m.PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        for d in _m.PathFinder.find_distributions(*args, **kwargs):
            name = _re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "")).lower()
            if name in _DISTS and _on_host(d.locate_file("")):
                continue
            yield d


_sys.meta_path[:] = [DeviceFinder if f is _m.PathFinder else f for f in _sys.meta_path]
for _k in [k for k in _sys.modules if k.split(".")[0] in _MODULES]:  # imported during start-up (a .pth file)
    del _sys.modules[_k]
'''


def download(dest: Path, specs: list) -> None:
    """pip download --no-deps of specs into dest (a wheel already there is not fetched again)."""
    dest.mkdir(parents=True, exist_ok=True)
    have = {norm(p.name.split("-")[0]) for p in dest.glob("*.whl")}
    need = [s for s in specs if norm(re.split(r"[=<>]", s)[0]) not in have]
    if need:
        print("+ pip download --no-deps " + " ".join(need), flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                        str(dest), *need], check=True)


def build(env_dir: Path = DEFAULT_DIR) -> dict:
    """Download the pins and the carried wheels (once), install the pins into <env_dir>/site without dependency
    resolution, write the start-up hook -> the environment's description (also <env_dir>/env.json)."""
    wheels, carried, site, hook = env_dir / "wheels", env_dir / "carried", env_dir / "site", env_dir / "hook"
    download(wheels, [f"{n}=={v}" if v else n for n, v in {**PINS, **SUPPLIED}.items()])
    download(carried, [f"{n}=={v}" if v else n for n, v in CARRIED.items()])
    stamp = site / "PINS.json"
    if not stamp.is_file() or json.loads(stamp.read_text()) != {**PINS, **SUPPLIED}:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True)
        stamp.write_text(json.dumps({**PINS, **SUPPLIED}))
    block = blocked()
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK.format(host=host_site_dirs(), dists=sorted(block),
                                                       modules=sorted({m for ms in block.values() for m in ms})))
    info = {"dir": str(env_dir), "pins": PINS, "blocked": block, "carried_wheels": sorted(p.name for p in
                                                                                          carried.glob("*.whl"))}
    (env_dir / "env.json").write_text(json.dumps(info, indent=1))
    return info


def environ(env_dir: Path = DEFAULT_DIR, base: dict = None) -> dict:
    """The environment variables of a process inside the simulation: the hook and the pins first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    paths = [str(env_dir / "hook"), str(env_dir / "site")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run(cmd: list, env_dir: Path = DEFAULT_DIR, **kw) -> subprocess.CompletedProcess:
    """cmd inside the simulation ("python" is this interpreter), from the repository root."""
    cmd = [sys.executable if c in ("python", "python3") else c for c in cmd]
    return subprocess.run(cmd, env=environ(env_dir, kw.pop("env", None)), cwd=kw.pop("cwd", ROOT), **kw)


CHECK = """
import importlib.metadata as md, importlib.util as u, json, sys
import torch, transformers, huggingface_hub, sentence_transformers, tokenizers, accelerate
seen = {m.__name__: m.__version__ for m in (torch, transformers, huggingface_hub, sentence_transformers, tokenizers,
                                            accelerate)}
gone = {}
for name in sys.argv[1:]:
    try:
        __import__(name)
        gone[name] = "importable"
    except ModuleNotFoundError:
        gone[name] = "blocked" if u.find_spec(name) is None else "find_spec sees it"
print(json.dumps({"versions": seen, "modules": gone}))
"""


def check(env_dir: Path = DEFAULT_DIR) -> dict:
    """From inside the simulation: the library versions seen and, for every blocked module, whether it imports."""
    info = json.loads((env_dir / "env.json").read_text())
    modules = sorted({m for ms in info["blocked"].values() for m in ms} - {n.replace("-", "_") for n in PINS} -
                     {"huggingface_hub", "sentence_transformers"})
    proc = run(["python", "-c", CHECK, *modules], env_dir, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("action", choices=["build", "run", "check"],
                   help="build: download and install the pins, write the hook; run: a command inside; check: the "
                        "versions and blocked modules seen inside")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="run: the command (after --)")
    p.add_argument("--dir", default=str(DEFAULT_DIR), help="the simulation's folder (default .cache/device_env)")
    args = p.parse_args(argv)
    env_dir = Path(args.dir)
    if args.action == "build":
        print(json.dumps(build(env_dir), indent=1))
    elif args.action == "check":
        print(json.dumps(check(env_dir), indent=1))
    else:
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            raise SystemExit("run: give the command after --")
        if not (env_dir / "env.json").is_file():
            raise SystemExit(f"{env_dir}: not built (python -m bench.device_env build)")
        raise SystemExit(run(cmd, env_dir).returncode)


if __name__ == "__main__":
    main()
