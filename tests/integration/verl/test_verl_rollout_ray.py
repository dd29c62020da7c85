"""``rollout.name=sparsecorr`` through verl's own machinery on a local Ray (CPU, started once for
the module): the plugin registered by verl's entry-point loader, the replica launched as verl's
hybrid mode does, requests served through verl's load balancer and ``LLMServerClient`` and through
verl's ``SingleTurnAgentLoop`` (one GRPO rollout), and the hybrid adapter's weight sync and
memory calls. A verl GRPO step itself needs GPU resource pools (docs: "verl", Status)."""

from __future__ import annotations

import asyncio
import os
import types
from pathlib import Path

import pytest
import torch

from tests.integration.verl.rollout_helpers import (
    PROMPTS,
    direct,
    model_config,
    need_verl_and_ray,
    rollout_config,
    save_tiny,
)
from tests.integration.verl.test_verl_loading import _entry_point_dist, _run_verl_plugin_loader

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ray_cluster():
    need_verl_and_ray()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="sparsecorr-test",
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
                                      "VERL_USE_EXTERNAL_PLUGINS": "sparsecorr"}})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def replica(ray_cluster, ckpt):
    """One replica launched the way verl's hybrid mode does (``init_hybrid`` over the trainer's
    worker group; here one CPU actor stands in for the FSDP worker)."""
    from sparsecorr_verl.plugin import install

    install()
    from verl.workers.rollout.replica import get_rollout_replica_class

    @ray_cluster.remote(num_cpus=0)
    class TrainerWorker:
        pass

    group = types.SimpleNamespace(workers=[TrainerWorker.remote()])

    cls = get_rollout_replica_class("sparsecorr")
    rep = cls(replica_rank=0, config=rollout_config(engine=_engine()),
              model_config=model_config(ckpt), gpus_per_node=1)
    asyncio.run(rep.init_hybrid(group))
    return rep


def _engine():
    from tests.integration.verl.rollout_helpers import ENGINE

    return dict(ENGINE)


def _reference(ckpt, **kw):
    from sparsecorr_verl.rollout import load_policy_copy

    return direct(load_policy_copy(str(ckpt), device=torch.device("cpu")), **kw)


def test_plugin_registers_the_backend_through_verls_loader(verl, plugin, monkeypatch, tmp_path):
    need_verl_and_ray()
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY, get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class

    plugin.uninstall()
    assert "sparsecorr" not in RolloutReplicaRegistry._registry
    assert ("sparsecorr", "async") not in _ROLLOUT_REGISTRY
    _entry_point_dist(tmp_path)
    _run_verl_plugin_loader(monkeypatch, tmp_path)
    from sparsecorr_verl.rollout.adapter import SparseCorrServerAdapter
    from sparsecorr_verl.rollout.replica import SparseCorrReplica

    assert get_rollout_replica_class("sparsecorr") is SparseCorrReplica
    assert get_rollout_class("sparsecorr", "async") is SparseCorrServerAdapter


def test_replica_refuses_tensor_parallel_and_pd(verl, ckpt):
    need_verl_and_ray()
    from sparsecorr_verl.rollout.replica import SparseCorrReplica

    with pytest.raises(ValueError, match=r"rollout.tensor_model_parallel_size: .* expected 1, got 2"):
        SparseCorrReplica(0, rollout_config(tensor_model_parallel_size=2), model_config(ckpt))


def test_eight_requests_through_verls_client_equal_direct_generate(replica, ckpt):
    """verl's ``LLMServerClient`` over its global load balancer (the agent loop's path), with
    ``full_determinism`` so request ids reach the server: 8 concurrent greedy requests share the
    server's running batch and each equals the direct ``generate`` of its prompt; seeded copies of
    one prompt with one seed are equal (the seed is the request's own, as in vLLM)."""
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    lb = get_router_handle(servers={replica.server_address: replica.server_handle}, full_determinism=True)
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "sparsecorr", "full_determinism": True}}})
    client = LLMServerClient(cfg, lb)
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
              "max_tokens": 6}
    seeded = {**params, "temperature": 1.0, "seed": 11}

    async def run():
        greedy = await asyncio.gather(*[client.generate(f"req-{i}", prompt_ids=list(PROMPTS[i // 4]),
                                                        sampling_params=dict(params)) for i in range(8)])
        sampled = await asyncio.gather(*[client.generate(f"seeded-{i}", prompt_ids=list(PROMPTS[0]),
                                                         sampling_params=dict(seeded)) for i in range(3)])
        return greedy, sampled

    outs, sampled = asyncio.run(run())
    assert replica_state(replica)["max_resident"] >= 2
    ref = _reference(ckpt, prompts=list(PROMPTS), max_new_tokens=6)
    for i, out in enumerate(outs):
        tokens, logp = ref[i // 4]
        assert out.stop_reason == "completed" and out.token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(logp), rtol=0, atol=1e-5)
    assert len({tuple(o.token_ids) for o in sampled}) == 1


def replica_state(replica):
    import ray

    return ray.get(replica.server_handle.state.remote())


def _word_tokenizer():
    """A word-level tokenizer over the tiny model's 128 ids (``w3`` .. ``w127``) whose chat
    template joins the messages' contents: what the agent loop tokenizes prompts with."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, 128)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


@pytest.fixture
def agent_loop_module(monkeypatch):
    """verl's agent loop, imported with a stand-in for Hydra (used only to instantiate agent
    loops by name, which this test does itself): hydra-core 1.3 needs omegaconf < 2.4, and the
    verl stack's tests run with omegaconf 2.4."""
    import importlib.util
    import sys

    if importlib.util.find_spec("hydra") is None:
        stub = types.ModuleType("hydra")
        stub.utils = types.SimpleNamespace(instantiate=None)
        monkeypatch.setitem(sys.modules, "hydra", stub)
    return importlib.import_module("verl.experimental.agent_loop.single_turn_agent_loop")


def test_single_turn_agent_loop_rollout_against_the_server(replica, ckpt, agent_loop_module):
    """verl's ``SingleTurnAgentLoop.run`` (what one GRPO rollout is), served by the replica:
    its response and ``rollout_log_probs`` are the direct greedy ``generate``'s."""
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "sparsecorr", "prompt_length": 16, "response_length": 6, "full_determinism": False}}})
    lb = get_router_handle(servers={replica.server_address: replica.server_handle})
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}

    async def run():  # the agent loop binds the running event loop when it is built
        loop = agent_loop_module.SingleTurnAgentLoop(
            trainer_config=DictConfigWrap(cfg), server_manager=LLMServerClient(cfg, lb),
            tokenizer=_word_tokenizer(), processor=None, dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(OmegaConf.create({})))
        return await asyncio.gather(*[loop.run(dict(params), raw_prompt=[
            {"role": "user", "content": " ".join(f"w{t}" for t in p)}]) for p in PROMPTS])

    outs = asyncio.run(run())
    assert [o.prompt_ids for o in outs] == [list(p) for p in PROMPTS]
    ref = _reference(ckpt, prompts=list(PROMPTS), max_new_tokens=6)
    for out, (tokens, logp) in zip(outs, ref):
        assert out.response_ids == tokens and out.response_mask == [1] * len(tokens)
        rollout_log_probs = out.as_dict()["rollout_log_probs"]  # the batch key the correction reads
        torch.testing.assert_close(rollout_log_probs, torch.tensor(logp), rtol=0, atol=1e-5)


def test_multi_turn_tool_loop_against_the_server(replica, ckpt, agent_loop_module):
    """verl's ``ToolAgentLoop`` (a multi-turn tool rollout) served by the replica: two assistant
    turns around one tool call. The loop sends its tool parser's ``stop_token_ids`` (honoured
    besides EOS) and the same request id on every turn; the second turn's prompt carries the
    first turn and the tool's answer; the tool's tokens are masked out of the response and every
    model token has its log-prob."""
    import importlib

    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    stop = 7

    @ToolParser.register("sparsecorr-test-forced")
    class ForcedCall(ToolParser):  # a random tiny model emits no tool syntax: every turn calls the tool
        @property
        def stop_token_ids(self):
            return [stop]

        async def extract_tool_calls(self, responses_ids, tools=None):
            return "", [FunctionCall(name="echo", arguments='{"n": 3}')]

    class Echo(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text="w40 w41 w42"), 0.0, {}

    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "echo", "description": "echo",
                                          "parameters": {"type": "object", "properties": {}}}})
    tool_loop = importlib.import_module("verl.experimental.agent_loop.tool_agent_loop")
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "sparsecorr", "prompt_length": 16, "response_length": 24, "full_determinism": False,
        "multi_turn": {"max_user_turns": 2, "max_assistant_turns": 2, "max_parallel_calls": 1,
                       "max_tool_response_length": 16, "tool_response_truncate_side": "left",
                       "format": "sparsecorr-test-forced"}}}})
    lb = get_router_handle(servers={replica.server_address: replica.server_handle})
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}

    async def run():
        loop = tool_loop.ToolAgentLoop(
            trainer_config=DictConfigWrap(cfg), server_manager=LLMServerClient(cfg, lb),
            tokenizer=_word_tokenizer(), processor=None, dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(OmegaConf.create({})), tools=ToolListWrap([Echo({}, schema)]))
        return await asyncio.gather(*[loop.run(dict(params), raw_prompt=[
            {"role": "user", "content": " ".join(f"w{t}" for t in p)}]) for p in PROMPTS])

    outs = asyncio.run(run())
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.prompt_ids == list(prompt) and out.num_turns == 4
        mask = out.response_mask
        first = mask.index(0)
        tool = first + mask[first:].index(1) if 1 in mask[first:] else len(mask)
        assert out.response_ids[first:tool] == [40, 41, 42]  # the tool's answer, masked out
        turn1 = out.response_ids[:first]
        assert turn1 and stop not in turn1[:-1] and 2 not in turn1[:-1]  # stop tokens end a turn
        assert turn1 == _reference(ckpt, prompts=[list(prompt)], max_new_tokens=len(turn1))[0][0]
        assert tool < len(mask) and len(out.response_logprobs) == len(out.response_ids)


def test_hybrid_adapter_syncs_weights_and_memory(replica, ckpt, monkeypatch):
    """The adapter verl builds in a trainer worker: ``release`` (sleep), ``resume(weights)``,
    ``update_weights`` with the actor's perturbed tensors (through verl's bucketed transfer: the
    server actor is on this node), ``resume(kv_cache)``; the next rollout equals a direct
    ``generate`` with those weights."""
    from sparsecorr_verl.rollout import load_policy_copy
    from verl.workers.rollout.base import get_rollout_class

    monkeypatch.setenv("RANK", "0")
    adapter = get_rollout_class("sparsecorr", "async")(config=rollout_config(), model_config=model_config(ckpt),
                                                       device_mesh=None)
    model = load_policy_copy(str(ckpt), device=torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    server = replica.server_handle

    async def run():
        await adapter.release()
        assert (await server.state.remote())["weights_on_host"]
        await adapter.resume(tags=["weights"])
        await adapter.update_weights(iter(model.state_dict().items()), global_steps=3)
        await adapter.resume(tags=["kv_cache"])
        return await server.generate.remote(list(PROMPTS[1]), {"temperature": 0.0, "max_tokens": 6,
                                                               "logprobs": True}, "after-sync")

    out = asyncio.run(run())
    tokens, logp = direct(model, [PROMPTS[1]], max_new_tokens=6)[0]
    assert out.token_ids == tokens and out.log_probs == pytest.approx(logp, abs=1e-5)
    assert out.extra_fields["global_steps"] == 3
    # one node and pyzmq here: verl's bucketed transfer (shared memory on the CPU); without pyzmq
    # the named tensors through Ray, saying why
    import importlib.util

    has_zmq = importlib.util.find_spec("zmq") is not None
    assert adapter.weight_path == ("bucketed" if has_zmq else "named_tensors")
    assert (adapter.weight_path_reason is None) == has_zmq
    assert os.environ["RANK"] == "0"
