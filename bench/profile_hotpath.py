"""Where kvgate's CPU goes on the request path: a sampling profile under load.

Runs one ``kvgate serve`` process in front of the zero-latency nginx upstream of
``bench/overhead.py`` (or, with ``--upstream python``, its two engine-shaped backends), records it with ``py-spy`` (a sampling profiler attached from
outside, so the process runs unmodified) while ``wrk`` drives it at concurrency 32, one
phase of non-stream requests and one of streams, and writes the top functions by self
and by cumulative (inclusive) time, in percent of the samples, to a text file.

Needs ``nginx``, ``wrk`` (Debian) and ``py-spy`` (PyPI: ``pip install py-spy``)::

    .venv/bin/python bench/profile_hotpath.py --label after --out bench/results/profile_after.txt
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.overhead import (  # noqa: E402
    BODY_NONSTREAM,
    BODY_STREAM,
    _wait_port,
    _wait_ready,
    start_kvgate,
    start_nginx,
    start_python,
    upstream_servers,
    wrk_rps,
)
from kvgate_demo.demo import Process, free_port  # noqa: E402


def summarise(raw: Path, top: int) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """py-spy's raw (collapsed) stacks -> (samples, top self %, top cumulative %)."""
    self_n: collections.Counter[str] = collections.Counter()
    cum_n: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        # py-spy's frame: "function (file.py:line)": group by function and file.
        names = [_frame(f) for f in frames]
        self_n[names[-1]] += n
        for name in set(names):
            cum_n[name] += n
    pct = 100.0 / max(1, total)
    return (
        total,
        [(k, v * pct) for k, v in self_n.most_common(top)],
        [(k, v * pct) for k, v in cum_n.most_common(top)],
    )


def _ours(name: str) -> bool:
    return any(f"({d}/" in name for d in ("gateway", "admission", "routing"))


def _frame(f: str) -> str:
    name, _, loc = f.partition(" (")
    path = loc.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/lib/python3", "wt-hotpath/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=10.0, help="per phase")
    ap.add_argument("--label", default="")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--upstream",
        choices=("nginx", "python"),
        default="nginx",
        help="nginx from memory, or two engine-shaped Python backends",
    )
    ap.add_argument("--src", type=Path, default=None, help="profile another checkout's kvgate")
    ap.add_argument("--keep-raw", type=Path, default=None, help="copy py-spy's stacks here")
    args = ap.parse_args()
    for tool in ("nginx", "wrk", "py-spy"):
        if not shutil.which(tool) and not (Path(sys.executable).parent / tool).exists():
            print(f"{tool} is not installed", file=sys.stderr)
            return 2
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-prof-"))
    workdir.chmod(0o755)
    up_ns, up_st, kv_ns, kv_st = free_port(), free_port(), free_port(), free_port()
    procs: list[Process] = []
    sections = []
    try:
        ups: dict[str, int | list[int]]
        if args.upstream == "nginx":
            procs.append(start_nginx(workdir, "upstream", upstream_servers(workdir, up_ns, up_st)))
            ups = {"non-stream": up_ns, "stream": up_st}
        else:
            for i, port in enumerate((up_ns, up_st)):
                procs.append(start_python(workdir, f"engine{i}", "engine_backend.py", [str(port)]))
            ups = {"non-stream": [up_ns, up_st], "stream": [up_ns, up_st]}
        for port in (up_ns, up_st):
            _wait_port(port)
        for kind, kv_port, body in (
            ("non-stream", kv_ns, BODY_NONSTREAM),
            ("stream", kv_st, BODY_STREAM),
        ):
            kv = start_kvgate(workdir, f"kvgate-{kind}", kv_port, ups[kind], src=args.src)
            procs.append(kv)
            _wait_port(kv_port)
            asyncio.run(_wait_ready(f"http://127.0.0.1:{kv_port}/ready"))
            url = f"http://127.0.0.1:{kv_port}/v1/chat/completions"
            wrk_rps(url, body, 2, workdir)  # warm up
            raw = workdir / f"{kind}.raw"
            spy = subprocess.Popen(
                [
                    pyspy,
                    "record",
                    "--pid",
                    str(kv.popen.pid),
                    "--rate",
                    "200",
                    "--format",
                    "raw",
                    "--output",
                    str(raw),
                    "--duration",
                    str(int(args.seconds) + 1),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)
            rps = wrk_rps(url, body, args.seconds, workdir)
            spy.wait(timeout=args.seconds + 30)
            if args.keep_raw is not None:
                args.keep_raw.mkdir(parents=True, exist_ok=True)
                shutil.copy(raw, args.keep_raw / raw.name)
            total, by_self, by_cum = summarise(raw, args.top)
            lines = [
                f"## {kind} ({args.upstream} upstream): wrk c=32 {args.seconds:.0f} s, {rps:.0f} req/s "
                f"(py-spy {total} samples)",
                "",
                "self %  function",
            ]
            lines += [f"{p:6.1f}  {name}" for name, p in by_self]
            lines += ["", "cumulative %  function"]
            lines += [f"{p:6.1f}  {name}" for name, p in by_cum]
            ours = [(k, v) for k, v in summarise(raw, 10_000)[2] if _ours(k)][: args.top]
            lines += ["", "cumulative %  kvgate's own functions (gateway/, admission/, routing/)"]
            lines += [f"{p:6.1f}  {name}" for name, p in ours]
            sections.append("\n".join(lines))
            print(sections[-1], flush=True)
            kv.stop()
            procs.remove(kv)
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    head = f"# kvgate hot-path profile{': ' + args.label if args.label else ''}\n\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(head + "\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
