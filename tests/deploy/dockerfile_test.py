"""deploy/docker/Dockerfile cannot be built here (no Docker engine), so this keeps what can be
checked without one:
 - the build stage runs the README's build commands ("<!-- build-commands -->" block), in
   order and verbatim: scripts/install-deps.sh, then the same cmake configure and build lines as
   scripts/run.sh; the Debian package list lives only in scripts/install-deps.sh;
 - the runtime image has exactly one libfabric, the AWS EFA installer's: no Debian libfabric
   package, and the checks that enforce it at build time are there;
 - the ldd-to-Debian-packages step, run here on the real binary (this machine is Debian 12, the
   build stage's base), names installed packages that cover every library the binary loads
   other than libfabric and the RDMA stack;
 - the image's user, entrypoint, cache directory and ports are what the manifests expect.

Usage: python3 dockerfile_test.py [--cleave BUILD/bin/cleave]
"""

import os
import re
import shlex
import subprocess
import sys
import unittest

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_lib as d  # noqa: E402

DOCKERFILE = os.path.join(d.REPO, "deploy", "docker", "Dockerfile")


def instructions(path=DOCKERFILE):
    """[(stage, INSTRUCTION, argument text)] with continuation lines joined."""
    out, stage, buf = [], None, ""
    with open(path) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not buf and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.lstrip().startswith("#") and buf:
                continue
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            buf += line
            word, _, rest = buf.strip().partition(" ")
            word = word.upper()
            if word == "FROM":
                m = re.search(r"\bAS\s+(\S+)", rest, re.I)
                stage = m.group(1) if m else rest
            out.append((stage, word, rest.strip()))
            buf = ""
    return out


def commands(run_text):
    """The shell commands of a RUN, split at top-level &&."""
    return [" ".join(c.split()) for c in re.split(r"\s&&\s", run_text) if c.strip()]


def readme_build_commands():
    with open(os.path.join(d.REPO, "README.md")) as f:
        text = f.read()
    m = re.search(r"<!-- build-commands -->\s*```sh\n(.*?)```", text, re.S)
    if not m:
        raise AssertionError("README.md has no <!-- build-commands --> block")
    return [" ".join(line.split()) for line in m.group(1).splitlines() if line.strip()]


def script_lines(name):
    with open(os.path.join(d.REPO, "scripts", name)) as f:
        return [" ".join(line.split()) for line in f if line.strip() and not line.startswith("#")]


def apt_packages():
    with open(os.path.join(d.REPO, "scripts", "install-deps.sh")) as f:
        text = f.read()
    m = re.search(r"APT_PACKAGES=\((.*?)\n\)", text, re.S)
    body = re.sub(r"#[^\n]*", "", m.group(1))
    return body.split()


class Dockerfile(unittest.TestCase):
    def setUp(self):
        self.ins = instructions()
        self.stages = [s for s, w, _ in self.ins if w == "FROM"]

    def stage_runs(self, stage):
        return [c for s, w, rest in self.ins if s == stage and w == "RUN" for c in commands(rest)]

    def test_stages(self):
        for want in ("cuda-devel", "build", "cuda-runtime", "runtime"):
            self.assertIn(want, self.stages)
        self.assertEqual(self.stages[-1], "runtime", "the last stage is the image")
        froms = {s: rest for s, w, rest in self.ins if w == "FROM"}
        self.assertTrue(froms["build"].startswith("cuda-devel"))
        self.assertTrue(froms["runtime"].startswith("cuda-runtime"))
        self.assertIn("cuda-nvcc", " ".join(self.stage_runs("cuda-devel")))
        self.assertIn("cuda-cudart-${CUDA_MAJOR_MINOR}", " ".join(self.stage_runs("cuda-runtime")))
        self.assertNotIn("nvcc", " ".join(self.stage_runs("cuda-runtime")))

    def test_the_build_stage_runs_the_readme_commands(self):
        want = readme_build_commands()
        self.assertEqual(want[0], "scripts/install-deps.sh")
        runs = self.stage_runs("build")
        # In order, verbatim, and nothing before them but what they need.
        pos = [runs.index(c) if c in runs else -1 for c in want]
        self.assertNotIn(-1, pos, f"the build stage {runs} lacks some of the README's {want}")
        self.assertEqual(pos, sorted(pos))
        self.assertEqual(pos[0], 0, "scripts/install-deps.sh is the first command")
        # The README's cmake lines are scripts/run.sh's (and test.sh's configure line).
        run_sh, test_sh = script_lines("run.sh"), script_lines("test.sh")
        for c in want:
            self.assertIn(c, run_sh, f"scripts/run.sh does not run `{c}`")
        self.assertIn(want[1], test_sh)
        self.assertIn("scripts/install-deps.sh", test_sh)

    def test_the_package_list_is_only_in_install_deps(self):
        for stage in ("build",):
            for c in self.stage_runs(stage):
                self.assertNotRegex(c, r"\bapt(-get)? install\b", f"{stage}: {c}")
        text = open(DOCKERFILE).read()
        for p in apt_packages():
            if p in ("git", "python3", "cmake", "clang"):
                continue  # words that occur in comments and commands
            self.assertNotIn(p, text, f"the Dockerfile names install-deps' package {p}")
        copies = [rest for s, w, rest in self.ins if s == "build" and w == "COPY"]
        self.assertEqual(copies[0].split()[0], "scripts/install-deps.sh",
                         "install-deps.sh is copied (and run) before the sources")

    def test_exactly_one_libfabric_in_the_image(self):
        runs = self.stage_runs("runtime") + self.stage_runs("cuda-runtime")
        for c in runs:
            if "apt-get install" in c:
                self.assertNotIn("libfabric", c)
        runtime = " ".join(runs)
        self.assertIn("efa_installer.sh", runtime)
        self.assertIn("--skip-kmod", runtime)
        self.assertIn("/opt/amazon/efa/lib", runtime)
        # The build-time checks: no other libfabric.so, no Debian libfabric1, ldd resolves to EFA's.
        self.assertIn("-name 'libfabric.so*' -not -path '/opt/amazon/efa/*'", runtime)
        self.assertIn("! dpkg -s libfabric1", runtime)
        self.assertIn("libfabric.so.1 => /opt/amazon/efa/lib", runtime)
        build = " ".join(self.stage_runs("build"))
        self.assertRegex(build, r"grep -Ev '\^\(libfabric1\|")

    def test_user_entrypoint_cache_and_ports_match_the_manifests(self):
        final = [(w, rest) for s, w, rest in self.ins if s == "runtime"]
        user = [rest for w, rest in final if w == "USER"][-1]
        self.assertTrue(user.isdigit() and int(user) != 0, "a numeric non-root USER")
        entry = [rest for w, rest in final if w == "ENTRYPOINT"][-1]
        self.assertEqual(yaml.safe_load(entry), ["/usr/local/bin/cleave"])
        env = " ".join(rest for w, rest in final if w == "ENV")
        cache = re.search(r"CLEAVE_CACHE_DIR=(\S+)", env).group(1)
        exposed = {int(p) for w, rest in final if w == "EXPOSE" for p in rest.split()}
        for obj in d.render("overlays/cpu-demo"):
            if obj["kind"] != "Deployment":
                continue
            spec = obj["spec"]["template"]["spec"]
            self.assertEqual(spec["securityContext"]["runAsUser"], int(user))
            for c in spec["containers"]:
                self.assertEqual(c["command"], ["cleave"])  # /usr/local/bin is on PATH
                envs = {e["name"]: e.get("value") for e in c.get("env", [])}
                self.assertEqual(envs.get("CLEAVE_CACHE_DIR"), cache)
                for p in c.get("ports", []):
                    self.assertIn(p["containerPort"], exposed)

    def test_the_runtime_package_step_on_the_real_binary(self):
        if d.CLEAVE is None:
            self.skipTest("no cleave binary given (--cleave)")
        if subprocess.run(["sh", "-c", "command -v dpkg"], capture_output=True).returncode != 0:
            self.skipTest("not a Debian system (no dpkg)")
        step = [c for c in self.stage_runs("build") if "$(ldd build/bin/cleave" in c]
        self.assertEqual(len(step), 1, self.stage_runs("build"))
        pipeline = step[0].replace("build/bin/cleave", shlex.quote(d.CLEAVE))
        pipeline = pipeline.replace("> /runtime-packages.txt", "")
        r = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], capture_output=True, text=True)
        packages = r.stdout.split()
        self.assertGreater(len(packages), 3, r.stderr)
        self.assertNotIn("libfabric1", packages)
        for p in packages:
            st = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True)
            self.assertIn("install ok installed", st.stdout, p)
        # Every library the binary loads is in one of those packages, or is libfabric / the RDMA
        # stack (the EFA installer's) or the C runtime (in every base image).
        ldd = subprocess.run(["ldd", d.CLEAVE], capture_output=True, text=True).stdout
        libs = re.findall(r"=> (/\S+)", ldd)
        paths = sorted(set(libs) | {os.path.realpath(x) for x in libs})
        q = subprocess.run(["dpkg", "-S"] + paths, capture_output=True, text=True)
        by_path = {}
        for line in q.stdout.splitlines():
            pkg, _, path = line.partition(": ")
            by_path[path.strip()] = pkg.split(":")[0].split(",")[0]
        owned = set()
        for lib in libs:
            pkg = by_path.get(lib) or by_path.get(os.path.realpath(lib))
            self.assertIsNotNone(pkg, f"no Debian package owns {lib}")
            owned.add((lib, pkg))
        for lib, pkg in owned:
            if pkg in ("libfabric1", "libibverbs1", "librdmacm1", "ibverbs-providers",
                       "libpsm2-2", "libpsm-infinipath1", "libefa1", "rdma-core", "libc6",
                       "libgcc-s1", "libstdc++6"):
                continue
            self.assertIn(pkg, packages, f"{lib} comes from {pkg}, which the image would not install")


if __name__ == "__main__":
    d.main(need_kubectl=False)
