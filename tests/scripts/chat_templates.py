#!/usr/bin/env python3
"""Chat-template conformance: `cleave template` on every NAME.jinja / NAME.cases.json pair of the
suite must print, line by line, exactly each case's expected text ({"rendered": ...}) or
expected error ({"error": ...}).

usage: chat_templates.py CLEAVE_BINARY SUITE_DIR
Exits 77 (skipped) when SUITE_DIR is absent or holds no cases.
"""
import glob
import json
import os
import subprocess
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    cleave, suite = sys.argv[1], sys.argv[2]
    case_files = sorted(glob.glob(os.path.join(suite, "*.cases.json")))
    if not case_files:
        print(f"SKIP: no chat-template cases in {suite}")
        return 77
    passed = failed = 0
    for path in case_files:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        template = os.path.join(suite, spec["template"])
        proc = subprocess.run([cleave, "template", "--template", template, "--cases", path],
                              capture_output=True, timeout=60)
        name = os.path.basename(path)
        if proc.returncode != 0:
            print(f"FAIL {name}: exit {proc.returncode}: {proc.stderr.decode(errors='replace')}")
            failed += len(spec["cases"])
            continue
        lines = proc.stdout.decode("utf-8").splitlines()
        if len(lines) != len(spec["cases"]):
            print(f"FAIL {name}: {len(lines)} output lines for {len(spec['cases'])} cases")
            failed += len(spec["cases"])
            continue
        for i, (case, line) in enumerate(zip(spec["cases"], lines)):
            got = json.loads(line)
            if "expected_error" in case:
                want = {"error": case["expected_error"]}
            else:
                want = {"rendered": case["expected"]}
            if got == want:
                passed += 1
            else:
                failed += 1
                print(f"FAIL {name} case {i}:\n  want {json.dumps(want, ensure_ascii=False)}\n"
                      f"  got  {json.dumps(got, ensure_ascii=False)}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
