"""The embedded engine through its real HTTP server, with the tiny model from conf/model/tiny.yaml.

Every log-prob the engine returns is checked against one plain full forward pass of the same
weights over prompt + output, which is what the trainer computes.
"""

from __future__ import annotations

import gc
import json
import threading
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from cellrunner.config import ModelConfig
from cellrunner.engine import EmbeddedEngine, save_safetensors
from cellrunner.engine_batch import GenRequest, KVBatch, sample
from cellrunner.model import FlatWeights, build_model, flatten_params, load_flat
from base import engine_key
from base.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4


@pytest.fixture(scope="module")
def model_cfg() -> ModelConfig:
    return ModelConfig(**yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))


@pytest.fixture(scope="module")
def vocab_size(model_cfg: ModelConfig) -> int:
    return get_tokenizer(model_cfg.tokenizer, model_cfg.compact_ranks).vocab_size


@pytest.fixture(scope="module")
def weights(model_cfg: ModelConfig, vocab_size: int) -> list[FlatWeights]:
    """Version 0 (the seeded init) and version 1 (a visibly different perturbation)."""
    w0 = flatten_params(build_model(model_cfg, vocab_size), 0)
    noise = np.random.default_rng(1).normal(0.0, 0.05, w0.data.shape).astype(np.float32)
    return [w0, FlatWeights(1, w0.specs, w0.data + noise)]


@pytest.fixture(scope="module")
def reference(model_cfg: ModelConfig, vocab_size: int, weights: list[FlatWeights]):
    models = {}
    for w in weights:
        models[w.version] = build_model(model_cfg, vocab_size).eval()
        load_flat(models[w.version], w)

    def logprobs(version: int, prompt: list[int], output: list[int]) -> list[float]:
        """log_softmax of one full forward over prompt + output, gathered at each output token."""
        ids = torch.tensor([prompt + output])
        with torch.inference_mode():
            logp = torch.log_softmax(models[version](input_ids=ids).logits[0], dim=-1)
        n = len(prompt)
        return logp[n - 1 : n - 1 + len(output)].gather(1, torch.tensor(output)[:, None])[:, 0].tolist()

    logprobs.models = models
    return logprobs


@pytest.fixture
def make_engine(model_cfg: ModelConfig, vocab_size: int, weights: list[FlatWeights]):
    engines = []

    def make(*, resume: bool = True, seed: int = 0, max_running: int = 64, api_key: str = "",
             **options: object) -> EmbeddedEngine:
        """An engine of the tiny model on loopback, at version 0 unless `resume` is False;
        `options` go to EmbeddedEngine as they are (prefix cache, KV tier, ...)."""
        engine = EmbeddedEngine(
            model_cfg=model_cfg, vocab_size=vocab_size, host="127.0.0.1", port=0,
            cell_id=len(engines), max_running=max_running, seed=seed, api_key=api_key, **options,
        )
        engines.append(engine)
        engine.start()
        if resume:
            engine.resume(weights[0])
        return engine

    yield make
    for engine in engines:
        engine.stop()


@pytest.fixture
def engine(make_engine) -> EmbeddedEngine:
    return make_engine()


def call(engine: EmbeddedEngine, path: str, body=None, *, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, object]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(engine.url + path, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    return status, (json.loads(text) if text else None)


def generate(engine: EmbeddedEngine, prompt: list[int], **sampling) -> dict:
    body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
    status, reply = call(engine, "/generate", body)
    assert status == 200, reply
    return reply


def assert_logprobs_match(reference, reply: dict, prompt: list[int], version: int) -> None:
    meta = reply["meta_info"]
    got = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == reply["output_ids"]
    want = reference(version, prompt, reply["output_ids"])
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def prompt_of(length: int, start: int = 100) -> list[int]:
    return [(start + 37 * i) % 1000 for i in range(length)]  # below every vocabulary size in conf/


# ---------------------------------------------------------------- batching and log-probs


def test_batched_kv_cache_matches_full_forward(reference) -> None:
    """Rows join mid-flight with shorter and longer prompts and leave early; every row's logits
    stay those of a full forward over its own tokens."""
    model = reference.models[0]
    batch = KVBatch()
    rng = np.random.default_rng(0)
    seqs: list[list[int]] = []

    def check(logits: torch.Tensor, rows: range) -> None:
        for row, i in zip(rows, range(logits.shape[0])):
            with torch.inference_mode():
                want = model(input_ids=torch.tensor([seqs[row]])).logits[0, -1]
            np.testing.assert_allclose(
                torch.log_softmax(logits[i], -1).numpy(), torch.log_softmax(want, -1).numpy(), atol=TOL, rtol=0
            )
        tokens = rng.integers(0, 1000, size=len(rows)).tolist()
        for row, t in zip(rows, tokens):
            seqs[row].append(t)
        batch.set_last(slice(rows.start, None), tokens)

    def join(*lengths: int) -> None:
        start = len(seqs)
        new = [prompt_of(n, start=7 * n) for n in lengths]
        seqs.extend(list(p) for p in new)
        reqs = [GenRequest(rid=str(n), input_ids=p, max_new_tokens=99, temperature=1.0, top_p=1.0, top_k=-1,
                           stop_token_ids=frozenset(), return_logprob=True, on_done=lambda s, b: None) for n, p in
                zip(lengths, new)]
        with torch.inference_mode():
            check(batch.prefill(model, reqs), range(start, len(seqs)))

    def decode() -> None:
        with torch.inference_mode():
            check(batch.decode(model), range(len(seqs)))

    join(7)
    decode()
    join(20, 3)  # one longer than the running row's context, one shorter
    decode()
    decode()
    batch.keep([0, 2])  # the longest row leaves: its padding columns go
    del seqs[1]
    decode()
    join(2)
    decode()
    batch.keep([])
    assert batch.reqs == []


def test_logprobs_match_full_forward_under_concurrency(engine, reference, monkeypatch) -> None:
    prompts = [prompt_of(n, start=n) for n in (3, 17, 40, 5, 64, 11, 29, 2)]
    max_new = [30, 5, 12, 40, 8, 25, 16, 33]
    batch_sizes = []
    decode = KVBatch.decode

    def spy(self, model):
        batch_sizes.append(len(self.reqs))
        return decode(self, model)

    monkeypatch.setattr(KVBatch, "decode", spy)
    # Hold the generation thread between iterations until all requests wait, so that they surely
    # share one prefill and then leave the batch one by one.
    gate = threading.Event()
    holder = threading.Thread(target=engine._batch_loop.call, args=(gate.wait,))
    holder.start()
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(generate, engine, p, max_new_tokens=n, temperature=1.0) for p, n in zip(prompts, max_new)
        ]
        while engine.num_running() < len(prompts):
            time.sleep(0.01)
        gate.set()
        replies = [f.result() for f in futures]
    holder.join()
    assert max(batch_sizes) == len(prompts) and min(batch_sizes) == 1
    for prompt, n, reply in zip(prompts, max_new, replies):
        assert reply["meta_info"]["completion_tokens"] == len(reply["output_ids"]) == n
        assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert reply["meta_info"]["prompt_tokens"] == len(prompt)
        assert reply["meta_info"]["weight_version"] == "0"
        assert_logprobs_match(reference, reply, prompt, 0)


def test_sample_logprob_scaling() -> None:
    """Greedy rows report unscaled log-probs, sampled rows log_softmax(logits / T) (SGLang)."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    reqs = [GenRequest(rid="g", input_ids=[1], max_new_tokens=1, temperature=t, top_p=1.0, top_k=-1,
                       stop_token_ids=frozenset(), return_logprob=True, on_done=lambda s, b: None) for t in (0.0, 0.5)]
    tokens, logprobs = sample(logits, reqs, torch.Generator().manual_seed(0))
    assert tokens[0] == int(logits[0].argmax())
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[tokens[0]]), abs=1e-6)
    assert logprobs[1] == pytest.approx(float(torch.log_softmax(logits[1] / 0.5, -1)[tokens[1]]), abs=1e-6)


# ---------------------------------------------------------------- sampling and finishing


def test_greedy_is_deterministic_and_is_the_argmax_path(engine, reference) -> None:
    prompt = prompt_of(9)
    first = generate(engine, prompt, max_new_tokens=12, temperature=0)
    second = generate(engine, prompt, max_new_tokens=12, temperature=0)
    assert first["output_ids"] == second["output_ids"]
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(12):
            ids.append(int(reference.models[0](input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert first["output_ids"] == ids[len(prompt) :]
    # top_k=1 and a tiny top_p leave only the argmax, whatever the temperature.
    assert generate(engine, prompt, max_new_tokens=12, top_k=1)["output_ids"] == first["output_ids"]
    assert generate(engine, prompt, max_new_tokens=12, top_p=1e-9)["output_ids"] == first["output_ids"]


def test_sampling_is_reproducible_from_seed(make_engine) -> None:
    prompt = prompt_of(6)
    a = generate(make_engine(seed=3), prompt, max_new_tokens=20)["output_ids"]
    b = generate(make_engine(seed=3), prompt, max_new_tokens=20)["output_ids"]
    assert a == b


def test_stop_token_ends_output_and_is_kept(engine) -> None:
    prompt = prompt_of(5, start=11)
    free = generate(engine, prompt, max_new_tokens=10, temperature=0)["output_ids"]
    stop = free[3]
    cut = free.index(stop) + 1
    reply = generate(engine, prompt, max_new_tokens=10, temperature=0, stop_token_ids=[stop, 999])
    assert reply["output_ids"] == free[:cut]
    assert reply["output_ids"][-1] == stop
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert reply["meta_info"]["completion_tokens"] == cut
    # ignore_eos also ignores stop_token_ids, as in SGLang.
    assert generate(engine, prompt, max_new_tokens=10, temperature=0, stop_token_ids=[stop], ignore_eos=True)[
        "output_ids"
    ] == free


def test_length_finish_and_zero_new_tokens(engine) -> None:
    reply = generate(engine, [1, 2, 3], max_new_tokens=4)
    assert len(reply["output_ids"]) == 4
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    empty = generate(engine, [1, 2, 3], max_new_tokens=0)
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"]["type"] == "length"


def test_sixteen_concurrent_requests_all_answered(engine) -> None:
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda i: generate(engine, prompt_of(4 + i, start=i), max_new_tokens=16), range(16)))
    assert all(len(r["output_ids"]) == 16 for r in replies)
    assert len({r["meta_info"]["id"] for r in replies}) == 16
    assert engine.num_running() == 0


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "bogus": 1}}, "unknown field `bogus`"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "4"}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [1, "x"]}}, "stop_token_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"input_ids": [1, 2], "sampling_params": []}, "sampling_params"),
        ({"input_ids": [1, "2"]}, "input_ids"),
        ({"input_ids": [[1, 2]]}, "input_ids"),
        ({"input_ids": [1, 999_999]}, "999999"),
        ({"input_ids": [-1]}, "-1"),
        ({"input_ids": []}, "empty"),
        ({"text": "hello"}, "input_ids"),
        ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
        ({"input_ids": [1], "rid": 5}, "rid"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ({"input_ids": [1] * 65_500, "sampling_params": {"max_new_tokens": 49}}, "context length"),  # tiny: 65,536
        ([1, 2, 3], "object"),
    ],
)
def test_malformed_generate_is_400(engine, body, fragment: str) -> None:
    status, reply = call(engine, "/generate", body)
    assert status == 400
    assert reply["error"]["type"] == "invalid_request_error"
    assert fragment in reply["error"]["message"]


def test_invalid_json_is_400_and_unknown_top_level_keys_are_ignored(engine) -> None:
    assert call(engine, "/generate", raw=b"{not json")[0] == 400
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "skip_special_tokens": False},
            "logprob_start_len": -1, "whatever": {"x": 1}}
    status, reply = call(engine, "/generate", body)
    assert status == 200 and len(reply["output_ids"]) == 2 and "output_token_logprobs" not in reply["meta_info"]


# ---------------------------------------------------------------- lifecycle


def test_health_and_model_info_through_lifecycle(make_engine, weights) -> None:
    engine = make_engine(resume=False)
    assert call(engine, "/health")[0] == 503
    assert call(engine, "/generate", {"input_ids": [1]})[0] == 503
    assert engine.weight_version is None
    engine.resume(weights[0])
    assert call(engine, "/health")[0] == 200
    status, info = call(engine, "/model_info")
    assert status == 200
    assert info["model_path"] == "embedded:tiny-qwen3" and info["is_generation"] is True
    assert info["weight_version"] == "0"
    assert engine.drain(timeout_s=5.0) == 0
    assert call(engine, "/health")[0] == 503
    assert call(engine, "/generate", {"input_ids": [1]})[0] == 503
    model = weakref.ref(engine._batch_loop._model)  # the one private peek: release must free the model
    engine.release()
    gc.collect()
    assert model() is None
    assert engine.weight_version is None
    assert call(engine, "/model_info")[1]["weight_version"] is None
    assert call(engine, "/generate", {"input_ids": [1]})[0] == 503
    engine.resume(weights[1])  # a released cell comes back to serving
    assert generate(engine, [1, 2], max_new_tokens=2)["meta_info"]["weight_version"] == "1"


def start_long_request(engine: EmbeddedEngine, rid: str, max_new_tokens: int = 1900) -> dict:
    """Send one long request in the background; return a dict that will hold its reply."""
    out: dict = {}

    def run() -> None:
        out["status"], out["reply"] = call(
            engine, "/generate",
            {"input_ids": [5, 6, 7], "rid": rid, "return_logprob": True,
             "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0}},
        )

    out["thread"] = threading.Thread(target=run)
    out["thread"].start()
    deadline = time.monotonic() + 30
    while engine.num_running() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return out


def test_drain_aborts_long_request_with_partial_output(engine, reference) -> None:
    pending = start_long_request(engine, "long")
    time.sleep(0.5)  # let it produce some tokens (their count is not asserted beyond > 0)
    assert engine.drain(timeout_s=0.2) == 1
    pending["thread"].join()
    assert pending["status"] == 200
    reply = pending["reply"]
    assert reply["meta_info"]["id"] == "long"
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(reply["output_ids"]) == reply["meta_info"]["completion_tokens"] < 1900
    assert_logprobs_match(reference, reply, [5, 6, 7], 0)
    assert engine.num_running() == 0
    assert call(engine, "/generate", {"input_ids": [1]})[0] == 503
    engine.release()


def test_abort_request_by_rid(engine) -> None:
    pending = start_long_request(engine, "victim")
    assert call(engine, "/abort_request", {"rid": "victim"})[0] == 200
    pending["thread"].join()
    assert pending["reply"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert call(engine, "/abort_request", {"abort_all": True})[0] == 200
    assert generate(engine, [1, 2], max_new_tokens=2)["meta_info"]["finish_reason"]["type"] == "length"


def test_client_disconnect_aborts_its_request(engine) -> None:
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1900}}).encode()
    req = urllib.request.Request(engine.url + "/generate", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(req, timeout=0.3)
    deadline = time.monotonic() + 30
    while engine.num_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_running() == 0


def test_update_weights_changes_outputs_and_version(engine, weights, reference) -> None:
    prompt = prompt_of(8)
    before = generate(engine, prompt, max_new_tokens=10, temperature=0)
    engine.update_weights(weights[1])
    assert engine.weight_version == 1
    after = generate(engine, prompt, max_new_tokens=10, temperature=1.0)
    assert after["meta_info"]["weight_version"] == "1"
    assert call(engine, "/model_info")[1]["weight_version"] == "1"
    assert_logprobs_match(reference, after, prompt, 1)
    greedy = generate(engine, prompt, max_new_tokens=10, temperature=0)
    assert greedy["output_ids"] != before["output_ids"]


def test_update_weights_mid_request_keeps_it_running(engine, weights) -> None:
    pending = start_long_request(engine, "spans", max_new_tokens=1000)
    deadline = time.monotonic() + 30
    while engine.num_output_tokens() == 0 and time.monotonic() < deadline:  # admitted is not yet decoding
        time.sleep(0.005)
    engine.update_weights(weights[1])
    pending["thread"].join()
    meta = pending["reply"]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 1000}
    assert meta["weight_version"] == "0"  # the version of its first token
    spans = meta["weight_versions"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == 1000
    assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
    assert spans[-1]["version"] == "1"


def test_update_weights_from_disk_round_trip(engine, weights, reference, tmp_path) -> None:
    save_safetensors(weights[1], str(tmp_path / "v1"))
    status, reply = call(engine, "/update_weights_from_disk",
                         {"model_path": str(tmp_path / "v1"), "weight_version": "7"})
    assert status == 200 and reply["success"] is True, reply
    assert engine.weight_version == 7
    prompt = prompt_of(12)
    out = generate(engine, prompt, max_new_tokens=8)
    assert out["meta_info"]["weight_version"] == "7"
    assert_logprobs_match(reference, out, prompt, 1)  # version 1's tensors, now labelled 7

    status, reply = call(engine, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and reply["success"] is False
    assert engine.weight_version == 7


# ---------------------------------------------------------------- long contexts


def test_prompt_past_the_old_2048_limit_is_served(engine, reference, model_cfg) -> None:
    """Harness prompts are tens of thousands of ids (Claude Code's first: ~22k with 1,024 ranks)."""
    assert model_cfg.max_position_embeddings >= 65536
    prompt = prompt_of(6000, start=21)
    reply = generate(engine, prompt, max_new_tokens=8, temperature=0.0)
    assert reply["meta_info"]["prompt_tokens"] == 6000
    assert_logprobs_match(reference, reply, prompt, 0)


def test_api_key_guards_every_route_but_health(make_engine, tmp_path):
    """With the run's key (base.engine_key), a caller without it gets SGLang's own 401 on
    /generate, aborts and weight loading, before its body is read; /health stays open."""
    key = engine_key.read_key(engine_key.write_key(tmp_path / "engine.key"))
    engine = make_engine(api_key=key)
    body = {"input_ids": prompt_of(8), "sampling_params": {"max_new_tokens": 2}}
    for headers in ({}, {"Authorization": "Bearer " + "0" * 64}, {"Authorization": key}):
        for path, req in (("/generate", body), ("/abort_request", {"rid": "x"}),
                          ("/update_weights_from_disk", {"model_path": str(tmp_path)})):
            assert call(engine, path, req, headers=headers) == (401, {"error": "Unauthorized"}), (path, headers)
        assert call(engine, "/model_info", headers=headers)[0] == 401
    assert call(engine, "/health")[0] == 200
    status, reply = call(engine, "/generate", body, headers=engine_key.headers(key))
    assert status == 200 and len(reply["output_ids"]) == 2
    assert engine_key.allowed("", "/generate", None)  # no key: an open engine (tests, bench doubles)


def test_engine_key_file_is_private(tmp_path):
    path = engine_key.write_key(tmp_path / "engine.key")
    assert path.stat().st_mode & 0o777 == 0o600
    assert engine_key.read_key(path) != engine_key.read_key(engine_key.write_key(tmp_path / "other.key"))
    path.chmod(0o644)
    with pytest.raises(ValueError, match="0600"):
        engine_key.read_key(path)
    bad = tmp_path / "bad.key"
    bad.write_text("short")
    bad.chmod(0o600)
    with pytest.raises(ValueError, match="hex key"):
        engine_key.read_key(bad)
