"""The ground floor every Gyre process stands on: the contracts they share.

The wire protocol (``wire``), typed config building (``typed_config``), child-process lifecycle
(``lifecycle``), CURVE keys (``curve``), the engine key (``engine_key``), execution tokens
(``execution_token``), the checkpoint layout (``checkpoints``), the tokenizer (``tokenizer``,
``hf_tokenizer``), a rank's environment (``ranks``), the sampling and algorithm config
(``algo_config``) and the advantage math (``advantages``).

``base`` imports no other Gyre package. Each process package (``cellrunner``, ``harness_proxy``,
``trajectory``, ``workloads``) imports only ``base`` and itself; ``controller`` composes and
launches them (tests/base/test_layering.py).
"""
