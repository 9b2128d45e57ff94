"""benchmarks/carve_algos.py without a GPU: how candidates from several heuristics are pooled, and the
refusal to run where there is no cuBLASLt (its measurements need CUDA: BENCHMARKS.md has them)."""

import pytest
import torch

from benchmarks import carve_algos
from lorakernels.cublaslt import Candidate


class _Query:
    """Stands in for an LtGemm: its heuristic's candidates, and which foreign algorithms its check takes."""

    def __init__(self, sm_count, algos, accepts=()):
        self.sm_count, self.accepts = sm_count, set(accepts)
        self.found = [Candidate(i, algo, 0, 1.0, {"tile": i}) for i, algo in enumerate(algos)]

    def candidates(self, count):
        return self.found[:count]

    def adopt(self, algo):
        return Candidate(-1, algo, 64, 0.5, {"tile": 99}) if algo in self.accepts else None


def test_the_runners_candidates_come_first_then_each_other_algorithm_once_that_its_check_accepts():
    runner = _Query(84, [b"a", b"b"], accepts=[b"c", b"d"])
    every_sm = _Query(0, [b"b", b"c", b"e"])
    more = _Query(100, [b"d", b"c"])
    got = carve_algos.gather(runner, [every_sm, more], 8)
    assert [(sms, c.algo) for sms, c in got] == [(84, b"a"), (84, b"b"), (0, b"c"), (100, b"d")]
    adopted = dict((c.algo, c) for _, c in got)[b"c"]
    assert adopted.index == 1 and adopted.workspace == 64  # its place in its own heuristic, the runner's check's workspace
    assert [c.algo for _, c in carve_algos.gather(runner, [every_sm], 1)] == [b"a"]  # `count` caps each heuristic


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs; measured there")
def test_it_refuses_to_run_without_cuda(capsys):
    with pytest.raises(SystemExit):
        carve_algos.main(["--device", "cpu"])
    assert "needs a CUDA device" in capsys.readouterr().err
