"""The OpenAI-compatible endpoints, driven by the real ``openai`` client, and the records that
turn an agent's conversation into a trajectory the trainer scores exactly as the server did:
``tandem serve``'s own, and the same endpoints served by the run's recording proxy in front of
a router (what agents on vLLM servers call)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from tiny_lm import decode, encode

openai = pytest.importorskip("openai")

from tandem.core.protocols import AgentRun, RolloutRequest
from tandem.core.records import PromptGroup, TaskItem
from tandem.engines.server.agent import OpenAIAgentWorkflow, agent_session, records_to_trajectory
from tandem.engines.server.client import ServerClient
from tandem.engines.server.router import ServerRolloutEngine, running
from tandem.engines.server.schemas import ConversationRecord
from tandem.engines.trainers.torch_train import TorchLogProbEngine
from tests.unit.engines.server.test_server_support import proxied, served

# Renders a conversation in the tiny vocabulary: each user turn ends with "=", answers follow.
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' %}={% endif %}{% endfor %}"


@pytest.fixture(scope="module")
def chat_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("chat")
    shutil.copytree(model_dir, folder, dirs_exist_ok=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return folder


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def records(url: str, conversation_id: str) -> list[ConversationRecord]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await ServerClient(url, session, request_timeout_s=30).conversation(conversation_id)


Records = Callable[[str], Awaitable[list[ConversationRecord]]]
FRONTS = ["tandem serve", "recording proxy"]


@contextlib.asynccontextmanager
async def openai_front(kind: str, model_dir: Path) -> AsyncIterator[tuple[str, Records]]:
    """The OpenAI endpoints over ``model_dir`` (their URL, without ``/v1``) and how a
    conversation's records are read: from ``tandem serve`` itself, or from the recording proxy
    (its first server's routes) in front of a router over one."""
    if kind == "tandem serve":
        async with served(model_dir) as (_, url):
            yield url, lambda conversation: records(url, conversation)
    else:
        async with proxied(model_dir) as (proxy, router):
            endpoint = router.endpoints[0]
            url = (await proxy.base_url(endpoint)).removesuffix("/v1")
            yield url, lambda conversation: proxy.records(endpoint, conversation)


@pytest.mark.parametrize("front", FRONTS)
async def test_completions_record_the_exact_tokens_logprobs_and_versions(model_dir: Path, front: str) -> None:
    async with openai_front(front, model_dir) as (url, recorded):
        models = await client(url).models.list()
        completion = await client(url).completions.create(
            model=models.data[0].id, prompt="1+2=", max_tokens=5, logprobs=1, seed=4, extra_body={"conversation_id": "c1"},
        )
        (record,) = await recorded("c1")
        assert await recorded("c1") == []  # collected once, then forgotten
    choice = completion.choices[0]
    assert completion.object == "text_completion" and completion.usage.completion_tokens == 5
    assert choice.finish_reason == "length" and choice.text == decode(record.output_ids)
    assert record.prompt_ids == encode("1+2=") and len(record.output_ids) == 5
    assert record.logprobs == choice.logprobs.token_logprobs and record.versions == [0] * 5


async def test_a_call_without_a_conversation_id_is_not_recorded_and_the_header_works(model_dir: Path) -> None:
    async with served(model_dir) as (server, url):
        await client(url).completions.create(model="m", prompt="6=", max_tokens=2)
        await client(url).completions.create(model="m", prompt="6=", max_tokens=2, extra_headers={"X-Conversation-Id": "h"})
        assert len(await records(url, "h")) == 1
        assert not server.conversations._records  # the untagged call left nothing behind


@pytest.mark.parametrize("front", FRONTS)
async def test_a_multi_turn_chat_becomes_one_trajectory_the_trainer_scores_alike(chat_model_dir: Path, front: str) -> None:
    async with openai_front(front, chat_model_dir) as (url, recorded):
        chat = client(url).chat.completions
        messages = [{"role": "user", "content": "1+2"}]
        # The history is text: it renders back to the same tokens unless the reply held a token
        # that decodes to nothing (this random model emits <pad> and <eos> as often as digits).
        # A reply that round-trips is what a conversation's single trajectory needs; find one.
        for seed in range(50):
            first = await chat.create(model="m", messages=messages, max_tokens=4, seed=seed,
                                      extra_body={"conversation_id": "t"})
            (probe,) = await recorded("t")
            if encode(decode(probe.output_ids)) == probe.output_ids:
                break
        await chat.create(model="m", messages=messages, max_tokens=4, seed=seed, extra_body={"conversation_id": "t"})
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "5"}]
        second = await chat.create(model="m", messages=messages, max_tokens=3, logprobs=True,
                                   extra_body={"conversation_id": "t"})
        recs = await recorded("t")
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert [len(r.output_ids) for r in recs] == [4, 3]
    assert [e.logprob for e in second.choices[0].logprobs.content] == recs[1].logprobs
    trajectory = records_to_trajectory(7, 0, recs, decode)
    assert trajectory.payload.prompt_ids == encode("1+2=")
    between = encode("5=")  # the user's next turn, as the template renders it
    assert trajectory.payload.response_ids == recs[0].output_ids + between + recs[1].output_ids
    assert trajectory.loss_mask == [1] * 4 + [0] * len(between) + [1] * 3
    async with TorchLogProbEngine(str(chat_model_dir)) as scorer:
        (expected,) = await scorer.logprobs([trajectory])
    trained = [(b, e) for b, e, m in zip(trajectory.behaviour_logprobs, expected, trajectory.loss_mask) if m]
    assert max(abs(b - e) for b, e in trained) < 1e-4


def test_a_conversation_that_rewrites_its_history_is_refused() -> None:
    from tandem.engines.server.schemas import ConversationRecord

    def rec(prompt: list[int], out: list[int]) -> ConversationRecord:
        return ConversationRecord(conversation_id="x", request_id="r", prompt_ids=prompt, output_ids=out,
                                  logprobs=[0.0] * len(out), versions=[0] * len(out), finish_reason="stop")

    with pytest.raises(ValueError, match="does not extend"):
        records_to_trajectory(0, 0, [rec([3, 4], [5]), rec([3, 9, 5], [6])], decode)


@pytest.mark.parametrize("front", FRONTS)
async def test_chat_without_a_template_is_refused(model_dir: Path, front: str) -> None:
    async with openai_front(front, model_dir) as (url, _):
        with pytest.raises(openai.BadRequestError, match="chat template"):
            await client(url).chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])


async def test_the_agent_workflow_yields_one_trajectory_per_request(chat_model_dir: Path) -> None:
    async def agent(run: AgentRun) -> None:  # written against the openai client only
        api = openai.AsyncOpenAI(base_url=run.base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": run.item.prompt}]
        await api.chat.completions.create(model="m", messages=messages, max_tokens=3, seed=run.seed, extra_body=run.extra_body)

    group = PromptGroup(3, TaskItem("12+3"), n=2)
    async with served(chat_model_dir) as (_, url):
        engine = ServerRolloutEngine([url], decode=decode, live_updates=True, request_timeout_s=30, health_interval_s=30,
                                     wait_for_server_s=10)
        async with running(engine):
            workflow = OpenAIAgentWorkflow(engine, agent_session(agent), decode=decode)
            out = [t async for t in workflow.rollout([RolloutRequest(group, i, seed=i) for i in range(2)])]
    assert sorted(t.index for t in out) == [0, 1]
    for t in out:
        assert t.prompt_id == 3 and t.num_actions == t.num_trained == 3 and t.loss_mask is None
        assert t.payload.prompt_ids == encode("12+3=") and t.versions == [0] * 3
