"""The second summation order of `make test` really is another order, and docs/development.md names
every file whose equivalence tests run under both (docs/development.md#numerics-on-other-cpus).

`make test` runs the `numerics` tests first as this machine computes (its threads, ATen's best CPU
kernels, MKL's own code path) and again under the Makefile's NUMERICS_ENV. A rerun that summed in
the same order would check nothing, so this runs one float32 probe of each kind of reduction the
tests depend on (a BLAS matmul, ATen's vectorized softmax over a vocabulary, a long sum split over
threads) under both orders and asserts that the bits differ: the order changed.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, numerics_env

PROBE = """
import hashlib, json, torch
g = torch.Generator().manual_seed(0)
a, b = torch.randn(64, 1000, generator=g), torch.randn(1000, 300, generator=g)
x = torch.randn(200_000, generator=g)
logits = torch.randn(8, 49152, generator=g)
out = {"matmul (BLAS)": a @ b, "log_softmax (ATen kernels)": torch.log_softmax(logits, -1),
       "sum (threads)": x.sum().reshape(1)}
print(json.dumps({"threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability(),
                  **{k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in out.items()}}))
"""

# What the machine's own order changes from the outside: a rerun must not inherit a pinned order.
ORDER_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "ATEN_CPU_CAPABILITY")


def probe(extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ORDER_VARIABLES}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, **extra}, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout)


def test_the_rerun_sums_in_another_order():
    """float32 results of one matmul, one softmax and one long sum, under the machine's order and
    under NUMERICS_ENV: each differs in its bits (the same float64 tests then pass under both)."""
    assert re.search(r'\$\(NUMERICS_ENV\) \$\(PY\) -m pytest [^\n]*-m "numerics and not cross_order"',
                     (REPO / "Makefile").read_text())
    second = numerics_env()
    assert {"MKL_CBWR", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS"} <= second.keys(), second
    own, other = probe({}), probe(second)
    assert other["threads"] == int(second["OMP_NUM_THREADS"]) and other["capability"] == "DEFAULT", other
    assert own["capability"] != "DEFAULT", own  # x86-64 torch picks AVX2 or AVX-512 kernels by itself
    assert own["matmul (BLAS)"] != other["matmul (BLAS)"]
    assert own["log_softmax (ATen kernels)"] != other["log_softmax (ATen kernels)"]
    if own["threads"] > other["threads"]:  # a 1-core machine has one order of threads only
        assert own["sum (threads)"] != other["sum (threads)"]


def files_with_numerics_tests() -> set[str]:
    marked = re.compile(r"pytest\.mark\.numerics|pytestmark\s*=.*numerics")
    return {p.name for p in (REPO / "tests").glob("test_*.py") if marked.search(p.read_text())}


def test_development_md_names_every_file_run_under_both_orders():
    """docs/development.md's list of the files whose tests run under both orders is the files that
    carry the `numerics` marker, no more, no fewer."""
    doc = (REPO / "docs" / "development.md").read_text()
    section = doc.split("## Numerics on other CPUs", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(test_\w+\.py)`", section.split("<!-- numerics files -->", 1)[1]
                            .split("<!-- /numerics files -->", 1)[0]))
    assert listed == files_with_numerics_tests(), (sorted(listed - files_with_numerics_tests()),
                                                   sorted(files_with_numerics_tests() - listed))


def numerics_tests() -> dict[str, str]:
    """Every test that carries the `numerics` marker (its own or its module's): {file::name: docstring}."""
    out = {}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                            and "numerics" in ast.unparse(n.value) for n in tree.body)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and (
                    module_marked or any("numerics" in ast.unparse(d) for d in node.decorator_list)):
                out[f"{path.name}::{node.name}"] = ast.get_docstring(node) or ""
    return out


PRECISION = re.compile(r"float64|fp64|float32|fp32|bf16|bfloat16|bitwise|token ids|same tokens")


def test_every_equivalence_test_says_what_it_compares_and_in_which_precision():
    tests = numerics_tests()
    assert len(tests) > 50  # the parser found them
    assert [name for name, doc in tests.items() if not PRECISION.search(doc)] == []


FLOAT64_RUN = """
import json, pathlib, sys, torch
sys.path.insert(0, sys.argv[2])
from conftest import make_policies
from marl_llm.rollout.decode import completion_logprobs
p = make_policies(pathlib.Path(sys.argv[1]), dtype="float64")
a = next(iter(p.adapter_parameters(0, "agent_aux")))
with p.acting(0) as model:
    logp, _, _ = completion_logprobs(model, [torch.tensor([1, 40, 41, 42, 2]), torch.tensor([1, 60])],
                                     [torch.tensor([50, 51, 2]), torch.tensor([52, 53, 54])], 2)
    logp.sum().backward()
print(json.dumps({"logp": logp.detach().flatten().tolist(), "grad": a.grad.flatten().tolist(),
                  "drawn_in_float64": bool((a.detach().float().double() != a.detach()).any())}))
"""


@pytest.mark.numerics
@pytest.mark.cross_order
def test_a_float64_policy_is_the_same_computation_under_both_orders(tiny_model_dir):
    """The tiny model's float64 policies built and scored in two processes, one under each summation
    order: log-probs and a LoRA gradient agree to FLOAT64_REL of their largest element. The LoRA
    weights are drawn in float64 (models.policies.created_in): peft's float32 draws round differently
    under ATen's scalar and vector kernels, which made these 1e-7 apart."""
    import torch

    from conftest import FLOAT64_REL, assert_close_to_scale

    def run(extra: dict[str, str]) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ORDER_VARIABLES}
        out = subprocess.run([sys.executable, "-c", FLOAT64_RUN, str(tiny_model_dir), str(REPO / "tests")],
                             env={**env, **extra}, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.splitlines()[-1])

    own, other = run({}), run(numerics_env())
    assert own["drawn_in_float64"] and other["drawn_in_float64"]
    for key in ("logp", "grad"):
        a, b = torch.tensor(own[key], dtype=torch.float64), torch.tensor(other[key], dtype=torch.float64)
        assert a.abs().max() > 0
        assert_close_to_scale(b, a, FLOAT64_REL, key)
