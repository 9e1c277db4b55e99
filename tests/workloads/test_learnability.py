"""The learnability probe runs small and prints its JSON; its batched sampler is exact."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from bench import learnability as probe
from workloads.tasksets.wordmap import make_tasks


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    """The probe pins torch to one thread; give the test process its setting back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _last_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert probe.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_small_learning_run(capsys: pytest.CaptureFixture[str]):
    out = _last_json(capsys, ["--small"])
    assert {"steps", "wall_s", "eval_reward_start", "eval_reward_end", "config", "curve", "host", "versions"} <= set(out)
    assert out["steps"] == 2 and [c["step"] for c in out["curve"]] == [0, 1, 2]
    assert all(0.0 <= c["eval_reward"] <= 1.0 for c in out["curve"])
    assert out["config"]["workload"]["group_size"] == 2


def test_small_vocab_bench(capsys: pytest.CaptureFixture[str]):
    out = _last_json(capsys, ["--vocab-bench", "--small"])
    assert out["vocabs"]["qwen_full"]["vocab_size"] == 151669
    assert set(out["speedup_vs_full"]) >= {"qwen_compact_4096"}
    assert all(v["step_s"] > 0 for v in out["vocabs"].values())


def test_batched_sampling_matches_one_sequence_at_a_time():
    wl, mc, _ = probe.load_configs()
    tok = probe.get_tokenizer(mc.tokenizer, mc.compact_ranks)
    model = probe.build_model(mc, tok.vocab_size)
    with torch.no_grad():  # sharpen the random init so that sampled tokens differ in log-prob
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5)
    prompts = [probe.first_prompt(tok, t) for t in make_tasks(wl)[0][:4]]
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    gen = torch.Generator().manual_seed(0)
    results = probe.sample(model, prompts, max_new_tokens=4, temperature=1.0, greedy=False, stop_id=tok.im_end, gen=gen)
    model.eval()
    for prompt, (out, logprobs) in zip(prompts, results):
        with torch.no_grad():
            ref = torch.log_softmax(model(input_ids=torch.tensor([prompt + out])).logits[0].float(), -1)
        want = [float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]
        assert logprobs == pytest.approx(want, abs=1e-4)
