"""The README's commands run as pasted (issue 54): every `python <script>.py` command of README.md's code blocks that
fits a CPU runs, in the order the README gives them, on a fresh folder holding the repository's files, at toy size:
its flags as written, followed by a few that shrink it (argparse keeps a repeated flag's last value). A command that
needs a GPU, the Hub or a file the reader supplies (`...`, another model, a corpus on /shared) is counted as left out,
with the reason, and at least the quick start's five must run. The demo (experiments/demo.sh) is read the same way:
its selection and training commands, run at toy size, cut no passage (no "raise --max_length" warning of its own).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OFFLINE_MODELS = {"all-MiniLM-L6-v2"}
# per script, what shrinks a run to seconds: appended after the command's own flags
TOY = {
    "select_groups.py": ["--max_docs", "40", "--inspect", "3"],
    "train.py": ["--max_train_steps", "2", "--per_device_train_batch_size", "4", "--max_length", "32"],
    "finetune.py": ["--max_train_steps", "2", "--per_device_train_batch_size", "4", "--passage_max_length", "32"],
    "evaluate.py": ["--limit", "10", "--max_length", "32"],
}


def shell_commands(text: str) -> list:
    """The commands of bash text: comments dropped, `\\` continuations joined, one string per command."""
    out, cur = [], ""
    for line in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(" ".join(cur.split()))
        cur = ""
    return out


def readme_commands() -> list:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [c for b in blocks for c in shell_commands(b)]


def why_not_on_a_cpu(argv: list):
    """None when the command runs here at toy size; else the reason it is left out."""
    if argv[0] != "python" or len(argv) < 2 or not argv[1].endswith(".py"):
        return "not a `python <script>.py` command (a launcher, a module, a shell script)"
    if "..." in argv:
        return "a template (`...` stands for the reader's flags)"
    for flag in ("--model_name_or_path", "--models"):
        if flag in argv:
            i = argv.index(flag) + 1
            while i < len(argv) and not argv[i].startswith("--"):
                if argv[i] not in OFFLINE_MODELS and not argv[i].startswith("runs/"):
                    return f"model {argv[i]} (the Hub)"
                i += 1
    if "--executor" in argv or "--dataset" in argv:
        return "a Hub dataset or a cluster executor"
    return None


def fresh_clone(tmp: Path) -> Path:
    """A folder with the repository's tracked files linked in (its own runs/ and outputs/ stay empty)."""
    tmp.mkdir(parents=True)
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for top in sorted({p.split("/")[0] for p in tracked}):
        (tmp / top).symlink_to(ROOT / top)
    (tmp / ".venv").symlink_to(ROOT / ".venv")
    return tmp


def run_as_pasted(command: str, cwd: Path, env: dict):
    argv = shlex.split(command)
    script = argv[1]
    # `python` is the venv's after the README's `source .venv/bin/activate`
    proc = subprocess.run([sys.executable, *argv[1:], *TOY[script]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def offline_env(tmp: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HOME": str(tmp / ".hf"), "MTEB_CACHE": str(tmp / ".mteb")}


def test_the_reader_finds_the_quick_start():
    """The reader itself: the quick start's commands are found whole and are the ones that fit a CPU."""
    commands = readme_commands()
    runs = [c for c in commands if why_not_on_a_cpu(shlex.split(c)) is None]
    scripts = [shlex.split(c)[1] for c in runs]
    assert scripts == ["select_groups.py", "select_groups.py", "train.py", "finetune.py", "evaluate.py"], runs
    assert all(s in TOY for s in scripts)
    left = [c for c in commands if why_not_on_a_cpu(shlex.split(c))]
    assert len(left) >= 10  # the GPU commands, the objectives' templates, the harness


@pytest.mark.slow
def test_the_readmes_commands_run_as_pasted(tmp_path, capsys):
    """Each CPU command of the README, as pasted after its set-up line, runs at toy size on a fresh folder, in order:
    groups -> pre-training -> fine-tuning on data/pairs.jsonl -> evaluation of the three models; the last lines
    of each are printed (the closing note quotes them)."""
    cwd, env = fresh_clone(tmp_path / "clone"), offline_env(tmp_path)
    ran, left = [], []
    for command in readme_commands():
        why = why_not_on_a_cpu(shlex.split(command))
        if why:
            left.append((command[:70], why))
            continue
        out = run_as_pasted(command, cwd, env)
        ran.append(command)
        with capsys.disabled():
            print(f"\n$ {command}  {' '.join(TOY[shlex.split(command)[1]])}\n" + "\n".join(
                [line for line in out.splitlines() if line.strip() and "%|" not in line][-3:]))
    assert len(ran) == 5
    assert (cwd / "runs/check/inspect.md").is_file() and (cwd / "runs/groups").is_dir()
    assert (cwd / "runs/xprt/model/config.json").is_file() and (cwd / "runs/ft/model/config.json").is_file()
    results = (cwd / "runs/eval/results.md").read_text(encoding="utf-8")
    assert "SciFact" in results and "STSBenchmark" in results and "ft/model" in results
    with capsys.disabled():
        print(f"\nleft out ({len(left)}): " + "; ".join(f"{c}: {w}" for c, w in left))


@pytest.mark.slow
def test_the_demo_cuts_no_passage_it_selected(tmp_path):
    """experiments/demo.sh's selection packs passages to the length it trains at, so its train.py prints no
    "raise --max_length" warning of its own: its two commands, with the demo's defaults, at toy size."""
    text = (ROOT / "experiments/demo.sh").read_text(encoding="utf-8")
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", text, flags=re.M))
    defaults.update({"OUT": "outputs/demo", "PY": "python", "MODEL": "all-MiniLM-L6-v2"})
    commands = [c.removeprefix("run ") for c in shell_commands(text) if c.startswith("run $PY select_groups.py")
                or c.startswith("run $PY train.py")]
    assert len(commands) == 2
    cwd, env = fresh_clone(tmp_path / "clone"), offline_env(tmp_path)
    for command in commands:
        command = re.sub(r"\$(\w+)", lambda m: defaults[m.group(1)], command).replace('"', "")
        argv = shlex.split(command)
        extra = ["--eval_steps", "1", "--eval_limit", "5"] if argv[1] == "train.py" else []
        proc = subprocess.run([sys.executable, *argv[1:], *TOY[argv[1]][:4], *extra], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
        if argv[1] == "train.py":
            out = proc.stdout + proc.stderr
            assert "passages longer than --max_length 64 tokens of this tokenizer: 0 of" in out
            assert "raise --max_length" not in out


def sentence_transformers_snippet() -> str:
    """The python block of README.md's "In a sentence-transformers pipeline" section, as a reader copies it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## In a sentence-transformers pipeline", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


@pytest.mark.slow
def test_the_sentence_transformers_section_runs_as_pasted(tmp_path, capsys):
    """The README's sentence-transformers snippet, pasted into a file and run as it is (toy size as written: 10
    steps) on a fresh folder after the quick start's selection and pre-training (at toy size): it trains from
    train.py's folder on its groups and saves a folder with the heads, whose card names the loss."""
    cwd, env = fresh_clone(tmp_path / "clone"), offline_env(tmp_path)
    for command in readme_commands():
        argv = shlex.split(command)
        if why_not_on_a_cpu(argv) is None and argv[1] in ("select_groups.py", "train.py") and "--inspect_only" \
                not in argv:
            run_as_pasted(command, cwd, env)
    (cwd / "st_snippet.py").write_text(sentence_transformers_snippet(), encoding="utf-8")
    proc = subprocess.run([sys.executable, "st_snippet.py"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with capsys.disabled():
        print("\n$ python st_snippet.py\n" + "\n".join(
            [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip() and "%|" not in line][-3:]))
    saved = cwd / "runs/st/model"
    assert (saved / "xprt_heads.safetensors").is_file() and (saved / "modules.json").is_file()
    assert "XPRTLoss" in (saved / "README.md").read_text(encoding="utf-8")
