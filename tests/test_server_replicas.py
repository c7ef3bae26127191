"""`specdecode serve --replicas`: the OpenAI routes in front of two Ray Serve engine replicas of
a tiny random Llama (test_server.py's), one local Ray cluster for the whole module.

Checked: every response equals the single-process server's (greedy and seeded sampling,
streamed or not); a response one replica generated reaches the other replica's drafts; the
shared memory is saved, reloaded and survives its actor's restart; a replica killed under load
loses no request (the ingress retries it, streams included); and without Ray, ``--replicas``
fails with one line naming the extra to install.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from specdecode import registry
from specdecode.server import BackgroundServer
from specdecode.server.app import Settings, create_app
from specdecode.server.loadtest import run_load
from specdecode.suffix_cache import SuffixCache
from test_server import chat
from tiny_server import EOS, MODEL, make_server, openai_client

PROMPTS = ["The quick brown fox", "Hello world!", "def add(a, b):", "How are you?"]


def ray_missing() -> str | None:
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        return "Ray Serve is not installed (pip install 'specdecode[ray]')"
    return None


needs_ray = pytest.mark.skipif(ray_missing() is not None, reason=str(ray_missing()))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(model, tokenizer, tmp_path_factory):
    """Two replicas, one slot and one thread each, syncing before every request; the suffix
    memory saved to a file; the ingress in this process, and Serve's HTTP proxy on loopback
    for the ``serve run`` ingress. Yields (background server, frontend, memory file, proxy)."""
    import ray

    from specdecode.server import ray_serve

    path = tmp_path_factory.mktemp("replicas") / "suffix.json"
    ray.init(num_cpus=2, include_dashboard=False, namespace=ray_serve.NAMESPACE,
             log_to_driver=False, configure_logging=False)
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ray_serve.ReplicaConfig(
        ray_serve.GivenModel(model, tokenizer, (EOS,)), registry.get("suffix").make_config(),
        slots=1, threads=1, max_queue=64, sync_interval=0.0, suffix_cache=str(path))
    settings = Settings(model_id=MODEL, method="suffix", max_queue=64)
    frontend = ray_serve.deploy(config, 2, settings)
    try:
        with BackgroundServer(create_app(frontend)) as background:
            yield background, frontend, path, f"http://127.0.0.1:{port}"
    finally:
        ray_serve.shutdown()
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single(model, tokenizer):
    """The single-process server over the same weights, for reference."""
    with make_server(model, tokenizer, parallel=1, method="suffix") as background:
        yield background


def ids_of(response) -> list[list[int]]:
    return [c.model_extra["token_ids"] for c in response.choices]


def wait_for_version(frontend, version: int, timeout: float = 10.0) -> dict:
    """The memory actor's stats once it holds ``version`` responses (pushes are async)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = frontend.memory.stats()
        if stats["version"] >= version or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@needs_ray
def test_replicas_give_the_single_process_servers_tokens(cluster, single):
    background, frontend, _, _ = cluster
    replicas, alone = openai_client(background), openai_client(single)
    ids = {"specdecode": {"return_token_ids": True}}
    cases = [dict(temperature=0), dict(temperature=1.2, top_p=0.95, seed=7, n=2)]
    results: dict = {}

    def ask(key, client, prompt, options):
        results[key] = ids_of(chat(client, prompt, max_tokens=24, extra_body=ids, **options))

    # concurrent requests, so both replicas serve some of them
    threads = [threading.Thread(target=ask, args=((p, i), replicas, p, o))
               for p in PROMPTS for i, o in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prompt in PROMPTS:
        for i, options in enumerate(cases):
            ask("ref", alone, prompt, options)
            assert results[(prompt, i)] == results["ref"], (prompt, options)
    streamed = chat(replicas, PROMPTS[0], max_tokens=24, stream=True, temperature=0)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat(alone, PROMPTS[0], max_tokens=24, temperature=0).choices[0].message.content
    health = httpx.get(background.url + "/health").json()
    assert health["status"] == "ok" and health["replicas"] == 2 and health["parallel"] == 2
    metrics = httpx.get(background.url + "/metrics").text
    assert 'specdecode_sequences_total{method="suffix",outcome="length"}' in metrics \
        or 'specdecode_sequences_total{method="suffix",outcome="stop"}' in metrics


@needs_ray
def test_a_response_from_one_replica_reaches_the_others_drafts(cluster):
    """Replica A answers a prompt; once its push lands, a request served by B drafts A's
    answer from the shared tree (B never saw it) and accepts far more per step."""
    _, frontend, _, _ = cluster
    from specdecode.server.scheduler import SequenceSpec

    handle = frontend.backend.handle.options(stream=True)
    config = registry.get("suffix").make_config()
    before = frontend.memory.stats()["version"]
    prompt = frontend.encode("Tell me about the lazy dog and the quick brown fox", chat=True)
    spec = SequenceSpec(prompt, 48, (), {}, registry.get("suffix"), config)

    async def generate():
        events = [e async for e in handle.generate.remote([spec])]
        return events[0][2], events[-1][2]  # ("start", 0, pid), ("done", 0, GenerationResult)

    import asyncio

    async def first_then_many():
        first = await generate()
        wait_for_version(frontend, before + 1)
        # six at once on two single-slot replicas: both serve some of them
        return first, await asyncio.gather(*[generate() for _ in range(6)])

    (pid, first), repeats = asyncio.run(first_then_many())
    assert all(r.token_ids == first.token_ids for _, r in repeats)
    others = [r.stats.mean_accepted for p, r in repeats if p != pid]
    assert others, "every repeat ran on the first replica"
    # the other replica drafts the whole answer from the shared tree
    assert min(others) > first.stats.mean_accepted + 2, (first.stats.mean_accepted, others)
    pulled = [frontend.backend.handle.memory_stats.remote() for _ in range(8)]
    assert any(p.result()["pulled_responses"] > 0 for p in pulled)


@needs_ray
def test_the_shared_memory_is_saved_and_survives_its_actors_restart(cluster):
    import ray

    from specdecode.server.shared_memory import MEMORY_ACTOR
    from specdecode.server.ray_serve import NAMESPACE

    background, frontend, path, _ = cluster
    chat(openai_client(background), "Save me, please", max_tokens=16)
    stats = wait_for_version(frontend, frontend.memory.stats()["version"] + 1)
    frontend.memory.save()
    saved = SuffixCache.load(path)
    assert len(saved.cached_requests) == stats["responses"] >= 1
    ray.kill(ray.get_actor(MEMORY_ACTOR, namespace=NAMESPACE), no_restart=False)
    deadline = time.monotonic() + 30
    while True:  # restarted from the file
        try:
            restored = frontend.memory.stats()
            break
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert restored["responses"] == stats["responses"]
    assert restored["tokens"] == saved.num_cached_tokens


@needs_ray
def test_the_serve_run_ingress_serves_the_same_routes(cluster, single):
    """The routes as a Serve deployment behind Serve's HTTP proxy (what ``serve run
    specdecode.server.ray_serve:app`` deploys), over the same engine replicas."""
    from ray import serve

    from specdecode.server import ray_serve

    _, frontend, _, proxy = cluster
    pool = frontend.backend
    config = ray_serve.ReplicaConfig(None, registry.get("suffix").make_config(), slots=1,
                                     max_queue=64, sync_interval=0.0)
    settings = Settings(model_id=MODEL, method="suffix", max_queue=64)
    serve.run(ray_serve.ingress_deployment().bind(pool.handle, config, 2, settings),
              name="http", route_prefix="/")
    try:
        client = openai.OpenAI(base_url=proxy + "/v1", api_key="x", max_retries=0, timeout=60)
        ids = {"specdecode": {"return_token_ids": True}}
        for options in (dict(temperature=0), dict(temperature=1.2, seed=3)):
            got = chat(client, PROMPTS[2], max_tokens=20, extra_body=ids, **options)
            ref = chat(openai_client(single), PROMPTS[2], max_tokens=20, extra_body=ids, **options)
            assert ids_of(got) == ids_of(ref)
        streamed = chat(client, PROMPTS[2], max_tokens=20, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == ref_text(single, PROMPTS[2])
        bad = httpx.post(proxy + "/v1/chat/completions", json={"model": MODEL, "messages": []})
        assert bad.status_code == 400 and "at least one message" in bad.json()["error"]["message"]
        assert httpx.get(proxy + "/health").json()["replicas"] == 2
    finally:
        serve.delete("http")


def ref_text(single, prompt: str) -> str:
    return chat(openai_client(single), prompt, max_tokens=20, temperature=0).choices[0].message.content


def kill_busiest_replica(pool, timeout: float = 30.0) -> int:
    """SIGKILL the replica process generating the most sequences, once one is busy."""
    deadline = time.monotonic() + timeout
    while not pool.serving:
        assert time.monotonic() < deadline, "no replica became busy"
        time.sleep(0.01)
    pid = pool.serving.most_common(1)[0][0]
    os.kill(pid, signal.SIGKILL)
    return pid


@needs_ray
def test_a_stream_whose_replica_dies_is_finished_by_another(cluster, single):
    """Killed after the client got text: the retry regenerates the same tokens on the other
    replica and the client gets the rest, nothing twice, nothing missing."""
    background, frontend, _, _ = cluster
    pool = frontend.backend
    retries = pool.retries
    stream = chat(openai_client(background), PROMPTS[1], max_tokens=200, temperature=0,
                  model=f"{MODEL}+ar", stream=True)
    pieces, killed = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if killed is None and "".join(pieces):
            killed = kill_busiest_replica(pool)
    expected = chat(openai_client(single), PROMPTS[1], max_tokens=200, temperature=0,
                    model=f"{MODEL}+ar").choices[0].message.content
    assert "".join(pieces) == expected
    assert pool.retries == retries + 1 and pool.failures == 0


@needs_ray
def test_a_replica_killed_under_load_loses_no_request(cluster):
    background, frontend, _, _ = cluster
    pool = frontend.backend
    retries = pool.retries
    before = frontend.memory.stats()["responses"]

    def kill_when_loaded():
        deadline = time.monotonic() + 60
        while pool.running + pool.waiting < 3:  # the load phase, past the references
            assert time.monotonic() < deadline
            time.sleep(0.01)
        kill_busiest_replica(pool)

    killer = threading.Thread(target=kill_when_loaded)
    killer.start()
    report = run_load(background.url, MODEL, PROMPTS + ["Speculative decoding", "thank you"],
                      requests=16, concurrency=4, max_tokens=40, time_limit=80)
    killer.join()
    data = report.as_dict()
    assert report.ok, data["problems"]
    assert data["completed"] == data["correct"] == 16
    assert pool.retries > retries and pool.failures == 0
    assert frontend.memory.stats()["responses"] >= before  # the memory is not a replica's
    # the cluster keeps serving (Serve replaces the dead replica)
    assert chat(openai_client(background), "Hello world!", max_tokens=8).usage.completion_tokens > 0


def test_replicas_without_ray_fail_with_one_clear_line():
    code = ("import sys; sys.modules['ray'] = None; sys.modules['ray.serve'] = None\n"
            "import specdecode.server.app, specdecode.server.scheduler  # one process: no Ray\n"
            "from specdecode.cli import main\n"
            "sys.exit(main(['serve', '--replicas', '2']))")
    env = dict(os.environ)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "specdecode: error: --replicas needs Ray Serve, which is not installed: "
        "pip install 'specdecode[ray]'")
