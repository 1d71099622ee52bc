"""tools/make_model.py: a small run is deterministic and writes a checkpoint that both loaders read."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def make(corpus: Path, out: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_model.py"), "--corpus", str(corpus), "--out", str(out),
                    "--device", "cpu", "--steps", "3", "--batch", "2", "--seq-len", "32", "--vocab", "400",
                    "--hidden", "64", "--eval-every", "2", "--accept-tokens", "4"], check=True, capture_output=True)


def test_small_run_is_deterministic_and_loads_in_both(tmp_path):
    """Two runs give byte-identical weights and tokenizer; transformers and minioverlap read them alike."""
    corpus = tmp_path / "corpus"
    shutil.copytree(ROOT / "minioverlap", corpus, ignore=shutil.ignore_patterns("checkpoints", "__pycache__"))
    make(corpus, tmp_path / "a")
    make(corpus, tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert "Made with `python tools/make_model.py" in (tmp_path / "a" / "README.md").read_text()

    from transformers import AutoModelForCausalLM
    from minioverlap import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    ours = LLM(model=str(tmp_path / "a")).generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    ref = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == ref[0, 3:].tolist()
