"""Engine runs for tests/integrations/test_vllm_engine.py, one scenario per process (vLLM keeps process-wide
state): ``python tests/integrations/vllm_scenarios.py SCENARIO MODEL TOKENIZER [ARG]`` prints one line
``RESULT {json}``. vLLM spawns its workers, hence the ``__main__`` guard."""

from __future__ import annotations

import gc
import json
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def prompts(lengths, offset=5):
    return [{"prompt_token_ids": [(offset + 7 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate(lengths)]


def make_llm(model, tokenizer, kind, **extra):
    from vllm import LLM

    from qfa.integrations.vllm import engine_kwargs

    calibration = extra.pop("calibration", None)
    kwargs = engine_kwargs(kv_cache=kind, calibration=calibration) if kind == "hif8" else engine_kwargs("bf16")
    return LLM(model, tokenizer=tokenizer, dtype=extra.pop("dtype", "float32"), enforce_eager=True,
               max_model_len=extra.pop("max_model_len", 1024), seed=0, **kwargs, **extra)


def with_engine(model, tokenizer, kind, use, **extra):
    """``use(llm)`` on a fresh engine, which is then torn down before the next one starts (a
    second engine's process groups would be destroyed when the first is collected)."""
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = make_llm(model, tokenizer, kind, **extra)
    try:
        return use(llm)
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def greedy(max_tokens=8, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def prompt_logprob_rows(out):
    """Per scored prompt position, {token: logprob} of the returned top entries."""
    return [{int(t): float(lp.logprob) for t, lp in row.items()} for row in out.prompt_logprobs if row is not None]


def layer_states(llm):
    def read(model):
        found = {}
        for name, module in model.named_modules():
            impl = getattr(module, "impl", None)
            state = getattr(impl, "state", None)
            if state is not None:
                found[name] = [float(state.k_scale), float(state.v_scale),
                               None if state.k_mean is None else state.k_mean.tolist()]
        return found

    return llm.apply_model(read)[0]


def scenario_basic(model, tokenizer, _):
    lengths = (7, 40, 130)

    def use(llm):
        first = llm.generate(prompts(lengths), greedy(prompt_logprobs=5))
        again = llm.generate(prompts(lengths), greedy())
        found = {"blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
                 "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
                 "tokens": [o.outputs[0].token_ids for o in first],
                 "again": [o.outputs[0].token_ids for o in again],
                 "cached_again": [o.num_cached_tokens for o in again],
                 "logprobs": [prompt_logprob_rows(o) for o in first]}
        if llm.llm_engine.vllm_config.cache_config.cache_dtype == "fp8":
            found["states"] = layer_states(llm)
        return found

    return {kind: with_engine(model, tokenizer, kind, use) for kind in ("bf16", "hif8")}


def scenario_preempt(model, tokenizer, calibration):
    """Eight 200-token requests writing 48 tokens each into a cache of 40 blocks of 16 tokens:
    they cannot all be resident, so the scheduler preempts and recomputes. With a calibration
    file the layers' state does not depend on which batch came first, so the tokens must be the
    roomy run's."""
    res = {}
    for label, blocks in (("roomy", None), ("tight", 40)):
        extra = {"disable_log_stats": False, "max_model_len": 512}
        if blocks is not None:
            extra.update(num_gpu_blocks_override=blocks, block_size=16, enable_prefix_caching=False)

        def use(llm):
            outs = llm.generate(prompts([200] * 8, offset=11), greedy(max_tokens=48))
            metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
            return {"tokens": [o.outputs[0].token_ids for o in outs], "preemptions": metrics.get("vllm:num_preemptions")}

        res[label] = with_engine(model, tokenizer, "hif8", use, calibration=calibration, **extra)
    return res


def scenario_abort(model, tokenizer, _):
    from vllm import SamplingParams  # noqa: F401

    ps = prompts((60, 90, 30), offset=3)

    def use(llm):
        engine = llm.llm_engine
        for i, p in enumerate(ps):
            engine.add_request(str(i), p, greedy(max_tokens=30))
        for _ in range(3):
            engine.step()
        engine.abort_request(["1"])
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
        alone = llm.generate([ps[0], ps[2]], greedy(max_tokens=30))
        return {"finished": sorted(finished), "same_as_alone": [finished.get("0") == alone[0].outputs[0].token_ids,
                                                                finished.get("2") == alone[1].outputs[0].token_ids]}

    return with_engine(model, tokenizer, "hif8", use)


def scenario_mixed(model, tokenizer, _):
    """A model whose second layer has a sliding window: qfa runs the first, CPU_ATTN the second."""

    def use(llm):
        out = llm.generate(prompts((20, 150)), greedy(max_tokens=10))
        cache = llm.llm_engine.vllm_config.cache_config
        return {"states": sorted(layer_states(llm)), "skip": list(cache.kv_cache_dtype_skip_layers),
                "tokens": [o.outputs[0].token_ids for o in out]}

    return with_engine(model, tokenizer, "hif8", use)


def scenario_calibrated(model, tokenizer, path):
    def use(llm):
        out = llm.generate(prompts((20,)), greedy())
        return {"states": layer_states(llm), "tokens": [o.outputs[0].token_ids for o in out]}

    return with_engine(model, tokenizer, "hif8", use, calibration=path)


def scenario_bad_calibration(model, tokenizer, path):
    try:
        make_llm(model, tokenizer, "hif8", calibration=path)
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        text = str(exc)
        cause = exc.__cause__
        while cause is not None:
            text += " | " + str(cause)
            cause = cause.__cause__
        return {"error": type(exc).__name__, "message": text}
    return {"error": None}


def scenario_tp(model, tokenizer, spec):
    """``spec``: "SIZE" or "SIZE:KIND" (KIND hif8, the default, or bf16)."""
    size, _, kind = spec.partition(":")
    def use(llm):
        llm.generate(prompts((24,), offset=1), greedy(max_tokens=1))  # a known first write fixes the scales
        outs = llm.generate(prompts((9, 33, 70)), greedy(max_tokens=12, logprobs=2))
        # per generated token, the top two candidates as [token, logprob], best first
        top2 = [[sorted(([int(t), float(lp.logprob)] for t, lp in step.items()), key=lambda e: -e[1])[:2]
                 for step in o.outputs[0].logprobs] for o in outs]
        return {"tokens": [o.outputs[0].token_ids for o in outs], "top2": top2}

    return with_engine(model, tokenizer, kind or "hif8", use, tensor_parallel_size=int(size), dtype="float32")


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}

if __name__ == "__main__":
    name, model_dir, tok_dir, *arg = sys.argv[1:]
    result = SCENARIOS[name](model_dir, tok_dir, arg[0] if arg else None)
    print("RESULT " + json.dumps(result, allow_nan=True), flush=True)
    sys.stdout.flush()
    os._exit(0)  # vLLM's atexit handlers can hang on a torn-down engine
