#!/usr/bin/env python3
"""`cleave bench serve` beside NVIDIA's AIPerf on the same load against one running server.

Both tools send the same prompts (written here as AIPerf's single_turn JSONL and as a ShareGPT
file for cleave), the same output length with ignore_eos, streaming, at the same concurrency;
token counts come from the server's usage in both (AIPerf --use-server-token-count). Prints a
Markdown table of the figures side by side. AIPerf's "inter token latency" is per request
(E2EL - TTFT) / (output tokens - 1), i.e. vLLM's TPOT; its ITL pooled over token gaps is not
reported, so ITL is compared with cleave's TPOT as well as its pooled ITL.

AIPerf is not a dependency of cleave: install it yourself (`pip install aiperf`, a venv is
best) and pass its executable with --aiperf. It needs a tokenizer directory: `cleave convert
--to safetensors MODEL.gguf DIR` writes one (tokenizer.json).

Usage:
  scripts/bench_vs_aiperf.py --cleave build/bin/cleave --url http://127.0.0.1:8000 \
      --tokenizer DIR --aiperf /path/to/venv/bin/aiperf [--num 40 --input-words 32 \
      --output-tokens 16 --concurrency 4]
"""

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile

WORDS = ("the a and to of in it is was he she they we you that on for with as at his her had "
         "said not but one day big little very happy sad dog cat tree ball sun mom dad play went "
         "saw got look run good new old red blue").split()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cleave", required=True)
    ap.add_argument("--aiperf", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory")
    ap.add_argument("--num", type=int, default=40)
    ap.add_argument("--input-words", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--aiperf-arg", action="append", default=[],
                    help="one more argument for `aiperf profile` (repeatable), e.g. "
                         "--aiperf-arg=--workers-max --aiperf-arg=1")
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="cleave-vs-aiperf-")
    os.makedirs(work, exist_ok=True)
    rng = random.Random(a.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(a.input_words)) for _ in range(a.num)]
    jsonl = os.path.join(work, "prompts.jsonl")
    with open(jsonl, "w") as f:
        for p in prompts:
            f.write(json.dumps({"text": p, "output_length": a.output_tokens}) + "\n")
    sharegpt = os.path.join(work, "sharegpt.json")
    with open(sharegpt, "w") as f:
        json.dump([{"id": str(i), "conversations": [
            {"from": "human", "value": p},
            {"from": "gpt", "value": " ".join(["x"] * a.output_tokens)}]}
            for i, p in enumerate(prompts)], f)
    url = a.url.rstrip("/")
    models = json.loads(subprocess.run(["curl", "-sf", url + "/v1/models"], capture_output=True,
                                       text=True, check=True).stdout)
    model = models["data"][0]["id"]

    def server_means():
        """The server's own mean TTFT and E2E latency so far (sum, count of its histograms)."""
        text = subprocess.run(["curl", "-sf", url + "/metrics"], capture_output=True, text=True,
                              check=True).stdout
        vals = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and not line.startswith("#"):
                vals[parts[0]] = float(parts[1])
        return {k: (vals.get(f"cleave:{k}_seconds_sum", 0), vals.get(f"cleave:{k}_seconds_count", 0))
                for k in ["time_to_first_token", "e2e_request_latency"]}

    def server_delta(before, after, key):
        s0, c0 = before[key]
        s1, c1 = after[key]
        return 1000 * (s1 - s0) / (c1 - c0) if c1 > c0 else None

    before_ours = server_means()
    ours_json = os.path.join(work, "cleave.json")
    subprocess.run([a.cleave, "bench", "serve", "--base-url", url, "--model", model,
                    "--dataset", "sharegpt:" + sharegpt, "--num-prompts", str(a.num),
                    "--request-rate", "inf", "--max-concurrency", str(a.concurrency),
                    "--ignore-eos", "--percentiles", "50,90,99", "--seed", str(a.seed),
                    "--save-result", ours_json, "--no-progress"], check=True)
    with open(ours_json) as f:
        ours = json.load(f)
    after_ours = server_means()

    art = os.path.join(work, "aiperf")
    subprocess.run([a.aiperf, "profile", "--model", model, "--url", url,
                    "--endpoint-type", "completions", "--streaming", "--tokenizer", a.tokenizer,
                    "--input-file", jsonl, "--custom-dataset-type", "single_turn",
                    "--concurrency", str(a.concurrency), "--request-count", str(a.num),
                    "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
                    "--use-legacy-max-tokens", "--random-seed", str(a.seed),
                    "--artifact-dir", art, "--ui-type", "none"] + a.aiperf_arg, check=True)
    after_theirs = server_means()
    found = glob.glob(os.path.join(art, "**", "profile_export_aiperf.json"), recursive=True)
    if not found:
        sys.exit(f"no profile_export_aiperf.json under {art}")
    with open(found[0]) as f:
        theirs = json.load(f)

    def ap_metric(name, stat):
        m = theirs.get(name) or theirs.get("records", {}).get(name)
        if isinstance(m, dict):
            return m.get(stat)
        return None

    rows = [
        ("completed requests", ours["completed"], ap_metric("request_count", "avg")),
        ("duration (s)", ours["duration"], ap_metric("benchmark_duration", "avg")),
        ("request throughput (req/s)", ours["request_throughput"],
         ap_metric("request_throughput", "avg")),
        ("output token throughput (tok/s)", ours["output_throughput"],
         ap_metric("output_token_throughput", "avg")),
        ("total output tokens", ours["total_output_tokens"],
         ap_metric("total_output_tokens", "avg")),
    ]
    for label, ours_key, ap_name in [("TTFT", "ttft", "time_to_first_token"),
                                     ("TPOT (AIPerf: inter token latency)", "tpot",
                                      "inter_token_latency"),
                                     ("E2EL (AIPerf: request latency)", "e2el",
                                      "request_latency")]:
        for stat, ap_stat in [("mean", "avg"), ("median", "p50"), ("p90", "p90"), ("p99", "p99")]:
            rows.append((f"{label} {stat} (ms)", ours[f"{stat}_{ours_key}_ms"],
                         ap_metric(ap_name, ap_stat)))
    for stat in ["mean", "median", "p90", "p99"]:
        rows.append((f"ITL pooled {stat} (ms, cleave only)", ours[f"{stat}_itl_ms"], None))
    # The server's own view of each run (router histograms): tells a measurement difference from
    # a server that ran slower during one tool's run (the tools share this machine's CPUs).
    for label, key in [("server-side TTFT mean (ms)", "time_to_first_token"),
                       ("server-side E2E latency mean (ms)", "e2e_request_latency")]:
        rows.append((label, server_delta(before_ours, after_ours, key),
                     server_delta(after_ours, after_theirs, key)))

    def fmt(v):
        if v is None:
            return "-"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    print(f"\nSame load: {a.num} prompts of {a.input_words} words, {a.output_tokens} output tokens "
          f"(ignore_eos), streaming completions, concurrency {a.concurrency}, model '{model}'.\n")
    print("| figure | cleave bench serve | aiperf | ratio |")
    print("|---|---:|---:|---:|")
    for label, o, t in rows:
        ratio = f"{o / t:.3f}" if isinstance(o, (int, float)) and isinstance(t, (int, float)) and t else "-"
        print(f"| {label} | {fmt(o)} | {fmt(t)} | {ratio} |")
    print(f"\nArtifacts in {work}")


if __name__ == "__main__":
    main()
