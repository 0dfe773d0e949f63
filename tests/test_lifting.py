"""modeling_xprt.py is liftable: copied alone into an empty folder with its one companion, plumbing/architectures.py
(no __init__.py: `plumbing` is then a namespace package), it imports and trains one xPRT step in a fresh Python that
cannot see the repository - what a forker does. The same step through the repository's own modules gives the same
losses."""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
COMPANIONS = ("modeling_xprt.py", "plumbing/architectures.py")  # the lifted files, nothing else
TERMS = ("xp_loss", "cross_fill_loss", "self_fill_loss", "mlm_loss", "uniformity_loss")

# The forker's script (written as step.py into the lifted folder). run() takes the modeling_xprt module as an
# argument, so the test runs the very same step through the repository's module in-process.
STEP = r'''"""One xPRT training step from a folder that holds modeling_xprt.py and plumbing/architectures.py only.
python step.py TOKENIZER_PATH [REPO_ROOT]: prints one JSON line (the loss terms, the repository modules loaded)."""
import json
import os
import sys


def rows():
    """Four groups in the groups schema XPRTCollator reads: doc_id, anchor, related (num_related passages)."""
    words = ("baseball pitcher game perfect inning rule catcher umpire league season team score runner base "
             "bat glove field strike ball walk history record").split()
    out = []
    for i in range(4):
        pick = lambda k, s: " ".join(words[(7 * i + 3 * s + 5 * j) % len(words)] for j in range(k))  # noqa: E731
        anchor = pick(14, 0)
        out.append({"doc_id": f"doc{i}", "anchor": anchor,
                    "related": [" ".join(anchor.split()[3:]) + " " + pick(4, s) for s in range(1, 5)]})
    return out


def run(mx, tok_path):
    """A tiny random BERT (the MiniLM tokenizer), XPRTModel(objective="xprt"), one collated batch, forward, backward,
    one AdamW step, then the loss again -> {term: float}."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order in the child and in the test's process
    try:
        tok = AutoTokenizer.from_pretrained(tok_path)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64)
        torch.manual_seed(0)
        model = mx.XPRTModel(BertForMaskedLM(cfg), objective="xprt")
        model.train()
        batch = mx.XPRTCollator(tok, num_related=4, max_length=32, seed=0)(rows())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        out = model(batch)
        out["loss"].backward()
        with_grad = sum(p.grad is not None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        updated = sum(not torch.equal(before[n], p) for n, p in model.named_parameters())
        after = model(batch)["loss"].item()
        result = {k: float(v.detach()) for k, v in out.items() if v.dim() == 0}
        result.update(loss_after_step=after, params=len(before), params_with_grad=with_grad, params_updated=updated,
                      batch_shape=list(batch["input_ids"].shape), decoder_passes=int(batch["dec_input_ids"].shape[1]))
        return result
    finally:
        torch.set_num_threads(threads)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.realpath(sys.argv[2]) if len(sys.argv) > 2 else None
    if repo is not None:  # the repository must be out of sight: only this folder and the installed packages
        assert all(os.path.realpath(p or os.getcwd()) != repo for p in sys.path), sys.path
    import modeling_xprt
    import plumbing
    import plumbing.architectures

    assert os.path.dirname(os.path.abspath(modeling_xprt.__file__)) == here, modeling_xprt.__file__
    assert os.path.dirname(os.path.abspath(plumbing.architectures.__file__)) == os.path.join(here, "plumbing")
    assert getattr(plumbing, "__file__", None) is None, plumbing.__file__  # a namespace package: no __init__.py
    assert [os.path.abspath(p) for p in plumbing.__path__] == [os.path.join(here, "plumbing")], plumbing.__path__
    result = run(modeling_xprt, sys.argv[1])
    names = ("modeling_xprt", "plumbing", "baselines", "train", "finetune", "evaluate", "select_groups",
             "select_groups_datatrove", "bench", "experiments", "revela")
    loaded = sorted(n for n in sys.modules if n.split(".")[0] in names)
    result["repo_modules"] = [n for n in loaded if getattr(sys.modules[n], "__file__", None)]
    result["namespace_packages"] = [n for n in loaded if getattr(sys.modules[n], "__file__", None) is None]
    try:  # the rest of the repository is not there
        import plumbing.common  # noqa: F401
        result["plumbing_common"] = "imported"
    except ModuleNotFoundError as err:
        result["plumbing_common"] = f"ModuleNotFoundError: {err}"
    result["modeling_xprt_file"] = modeling_xprt.__file__
    print(json.dumps(result))


if __name__ == "__main__":
    main()
'''


def lift(folder: Path) -> Path:
    """Copy the two files into `folder` as a forker would, write step.py beside them -> the script's path."""
    for rel in COMPANIONS:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, folder / rel)
    script = folder / "step.py"
    script.write_text(STEP)
    return script


def fork_env() -> dict:
    """The environment of a forker's shell: no PYTHONPATH (nor any other PYTHON* variable), Hugging Face offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def test_modeling_lifts_alone(tmp_path):
    from plumbing.common import resolve_model_path

    tok_path = resolve_model_path("all-MiniLM-L6-v2")
    script = lift(tmp_path)
    assert not (tmp_path / "plumbing" / "__init__.py").exists()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == sorted(
        [*COMPANIONS, "step.py"])
    # -E: no PYTHON* variable; -s: no user site-packages. Not -I: its -P would drop the script's folder from sys.path,
    # which a forker's `python step.py` has (the folder that holds modeling_xprt.py).
    proc = subprocess.run([sys.executable, "-E", "-s", script.name, tok_path, str(ROOT)], cwd=tmp_path,
                          env=fork_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))

    assert result["plumbing_common"].startswith("ModuleNotFoundError"), result["plumbing_common"]
    assert Path(result["modeling_xprt_file"]).resolve().parent == tmp_path.resolve()
    assert result["repo_modules"] == ["modeling_xprt", "plumbing.architectures"], result["repo_modules"]
    assert result["namespace_packages"] == ["plumbing"], result["namespace_packages"]
    for term in ("loss", *TERMS, "loss_after_step"):
        assert term in result and math.isfinite(result[term]), (term, result)
    assert result["batch_shape"][:2] == [4, 5] and result["decoder_passes"] == 10  # G=4, 1 + 4 passages, 2R + 2
    assert result["params_with_grad"] > 0 and result["params_updated"] > 0

    # the same step through the repository's own modeling_xprt, in this process: the same numbers
    import modeling_xprt

    spec = importlib.util.spec_from_file_location("lifted_step", script)
    step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step)
    rng = torch.get_rng_state()
    try:
        here = step.run(modeling_xprt, tok_path)
    finally:
        torch.set_rng_state(rng)
    for term in ("loss", *TERMS, "loss_after_step"):
        assert math.isclose(here[term], result[term], rel_tol=1e-5, abs_tol=1e-6), (term, here[term], result[term])
    assert {k: here[k] for k in ("params", "params_with_grad", "params_updated")} == {
        k: result[k] for k in ("params", "params_with_grad", "params_updated")}
