"""``tritoninfer demo --hf``: a transformers model served by ``generate_batch`` on tritoninfer's
attention and checked against transformers' own attention on the same weights (CPU: tiny models
through the Triton interpreter)."""

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.24.0")

from tritoninfer.demo import main  # noqa: E402
from tritoninfer.demo.hf_transformers import model_configs  # noqa: E402

WORKLOAD = ["--num-requests", "3", "--prompt-len", "5-9", "--gen-len", "3", "--quiet"]


@pytest.mark.parametrize("name", ["llama3", "gpt_oss"])
def test_hf_config_serves_and_checks(capsys, name):
    status = main(["--hf", name, "--check", *WORKLOAD])
    text = capsys.readouterr().out
    assert status == 0, text
    assert f"random weights ({name} config" in text and "generate_batch" in text
    assert text.count(": ok") == 2, text


def test_hf_checkpoint_folder(capsys, tmp_path):
    cfg, cls, _ = model_configs()["qwen3"]
    torch.manual_seed(1)
    cls._from_config(cfg).eval().save_pretrained(tmp_path)
    status = main(["--hf", str(tmp_path), "--check", *WORKLOAD])
    text = capsys.readouterr().out
    assert status == 0, text
    assert f"Qwen3ForCausalLM checkpoint {tmp_path}" in text and text.count(": ok") == 2


def test_hf_check_can_fail(capsys):
    """A tolerance no float computation meets: the logits check fails and the demo exits 1."""
    status = main(["--hf", "mistral", "--check", "--tolerance", "1e-12", *WORKLOAD])
    text = capsys.readouterr().out
    assert status == 1 and "FAILED" in text, text


def test_hf_bad_arguments(capsys):
    assert main(["--hf", "no-such-model", *WORKLOAD]) == 2
    assert "not a folder and not one of llama3" in capsys.readouterr().err
    for extra in (["--layers", "3"], ["--arch", "deepseek"], ["--top-k", "5"]):
        assert main(["--hf", "llama3", *extra]) == 2
        assert f"--hf: the model and its greedy generation come from transformers; drop {extra[0]}" in \
            capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama3", "gemma2"])
def test_gpu_hf_serves_and_checks(capsys, name):
    """On a GPU: the realistic shapes (32/8 heads, head_dim 128; Gemma 2 head_dim 256, soft cap) in
    bf16 through generate_batch, checked against transformers' own attention."""
    status = main(["--hf", name, "--check", "--num-requests", "8", "--prompt-len", "64-512", "--gen-len", "8",
                   "--quiet"])
    text = capsys.readouterr().out
    assert status == 0, text
    assert text.count(": ok") == 2, text
