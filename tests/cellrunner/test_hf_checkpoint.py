"""model.path: a local Hugging Face checkpoint folder, dense and MoE, as version 0.

The folders are written here by ``cellrunner.make_checkpoint`` (random init through
``transformers``, the full 151,936-row vocabulary, 2 layers, Qwen3's tokenizer.json rebuilt from
the real BPE ranks). Checked: the tokenizer is the folder's own and agrees with the bundled Qwen
vocabulary; every cell's model is the checkpoint; the embedded engine's log-probs equal
``transformers``' forward of the checkpoint; the config refuses what it cannot run, in one line.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from cellrunner.config import ModelConfig
from cellrunner.engine import EmbeddedEngine
from cellrunner.hf_folder import CheckpointError, check_folder
from cellrunner.make_checkpoint import QWEN3_VOCAB_ROWS, write_checkpoint
from cellrunner.model import build_model, flatten_params, vocab_rows, weights_digest
from base.typed_config import ConfigError, build
from base.hf_tokenizer import HFTokenizer
from harness_proxy.template import render_messages
from base.tokenizer import get_tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ckpt")
    return {"dense": write_checkpoint(base / "dense"), "moe": write_checkpoint(base / "moe", moe=True, seed=1)}


def hf_model_cfg(path: Path) -> ModelConfig:
    raw = yaml.safe_load((ROOT / "conf/model/qwen3_hf.yaml").read_text())
    return build(ModelConfig, {**raw, "path": str(path)})


CONVERSATION = [
    {"role": "system", "content": "You fix Python bugs."},
    {"role": "user", "content": "The test says: AssertionError: 3 != 4 — naïve café 日本語 🎉. Literal <|im_end|> here."},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "bash", "arguments": json.dumps({"cmd": "pytest -q tests/test_x.py"})}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "1 failed, 3 passed in 0.02s\n\tdef f(x):\n        return x+1"},
]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


def test_the_tokenizer_is_the_checkpoints_own_and_qwens(folders):
    tok = load_tokenizer("hf", 1024, str(folders["dense"]))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 151669
    qwen = get_tokenizer("qwen")
    # The template's control tokens at the checkpoint's ids (Qwen3's: <|im_start|> is 151644).
    assert tok.im_start == 151644 and tok.im_end == 151645 and tok.specials["<tool_call>"] == 151657
    ids = render_messages(tok, CONVERSATION, tools=TOOLS)
    assert ids == render_messages(qwen, CONVERSATION, tools=TOOLS)
    # Harness text stays text: the literal <|im_end|> in the user's message is not the control id.
    start = ids.index(tok.im_start, 1)  # the user's turn: it ends at the first control <|im_end|>
    assert tok.decode(ids[start : ids.index(tok.im_end, start)]).endswith("Literal <|im_end|> here.")
    assert tok.encode("x<|im_end|>y") != [*tok.encode("x"), tok.im_end, *tok.encode("y")]
    assert tok.decode(tok.encode("naïve café 日本語 🎉")) == "naïve café 日本語 🎉"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_version_zero_is_the_checkpoint_and_the_engine_scores_as_transformers(folders, kind):
    folder = folders[kind]
    cfg = hf_model_cfg(folder)
    rows = vocab_rows(cfg)
    assert rows == QWEN3_VOCAB_ROWS  # padded as the checkpoint is, past the tokenizer's 151,669
    reference = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    assert type(reference).__name__ == ("Qwen3MoeForCausalLM" if kind == "moe" else "Qwen3ForCausalLM")
    w0 = flatten_params(build_model(cfg, rows), 0)
    assert weights_digest(w0) == weights_digest(flatten_params(reference, 0))
    assert weights_digest(w0) == weights_digest(flatten_params(build_model(cfg, rows), 0))  # every cell alike

    engine = EmbeddedEngine(model_cfg=cfg, vocab_size=rows, host="127.0.0.1", port=0, cell_id=0, max_running=4, seed=3)
    engine.start()
    try:
        engine.resume(w0)
        prompt = render_messages(load_tokenizer("hf", 1024, str(folder)), CONVERSATION, tools=TOOLS)
        body = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 12, "temperature": TEMPERATURE, "ignore_eos": True}}
        req = urllib.request.Request(f"{engine.url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            reply = json.loads(resp.read())
    finally:
        engine.stop()
    out = reply["output_ids"]
    got = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
    assert len(out) == 12
    with torch.inference_mode():
        logits = reference(input_ids=torch.tensor([prompt + out])).logits[0].float()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    want = logp[len(prompt) - 1 : len(prompt) - 1 + len(out)].gather(1, torch.tensor(out)[:, None])[:, 0]
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=0)


def test_what_the_config_refuses_is_one_clear_line(folders, tmp_path):
    raw = yaml.safe_load((ROOT / "conf/model/qwen3_hf.yaml").read_text())
    with pytest.raises(ConfigError, match="model.path: required"):
        build(ModelConfig, raw)  # the YAML's ??? as it comes through unset
    with pytest.raises(ConfigError, match="tokenizer: hf reads the checkpoint's tokenizer.json; set model.path"):
        build(ModelConfig, {**raw, "path": ""})
    with pytest.raises(ConfigError, match=r"want 0 for \['hidden_size'\]"):
        build(ModelConfig, {**raw, "path": str(folders["dense"]), "hidden_size": 64})
    with pytest.raises(CheckpointError, match="is not a folder"):
        check_folder(str(tmp_path / "nowhere"), want_tokenizer=True)
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32000}))
    with pytest.raises(CheckpointError, match="is a 'llama' model"):
        check_folder(str(other), want_tokenizer=False)
    bare = tmp_path / "bare"
    shutil.copytree(folders["dense"], bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        check_folder(str(bare), want_tokenizer=True)
    assert check_folder(str(bare), want_tokenizer=False)["vocab_size"] == QWEN3_VOCAB_ROWS


@pytest.mark.parametrize("preset", ["qwen3_0_6b", "qwen3_8b", "qwen3_32b", "qwen3_30b_a3b", "qwen3_235b_a22b"])
def test_presets_give_a_parallel_layout_and_a_path_only(preset, folders):
    """A preset composes over qwen3_hf: the sizes stay the folder's, the trainer and the engine
    take its per-cell layout unless the command line says otherwise."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from controller.config import build_config

    raw = yaml.safe_load((ROOT / "conf/model" / f"{preset}.yaml").read_text())
    assert set(raw) == {"defaults", "name", "path", "parallel"}
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"model={preset}", f"model.path={folders['dense']}", "trainer=megatron",
                                           "engine=sglang", "cluster.ranks_per_node=8",
                                           "engine.weight_dir=/shared/gyre-weights"])  # 235B's servers span 2 nodes
    built = build_config(OmegaConf.to_container(cfg, resolve=True))
    par = built.model.parallel
    assert built.model.tokenizer == "hf" and built.model.hidden_size == 0
    assert (built.trainer.tensor_model_parallel_size, built.trainer.pipeline_model_parallel_size,
            built.trainer.expert_model_parallel_size) == (par.trainer_tp, par.trainer_pp, par.trainer_ep)
    assert (built.engine.tp_size, built.engine.ep_size, built.engine.nnodes) == (par.engine_tp, par.engine_ep,
                                                                                 par.engine_nnodes)
