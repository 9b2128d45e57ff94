"""benchmarks/carve_algos.py without a GPU: the refusal to run where there is no cuBLASLt (its measurements
need CUDA: BENCHMARKS.md has them; how it pools candidates is tests/lorakernels/test_cublaslt.py's)."""

import pytest
import torch

from benchmarks import carve_algos


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs; measured there")
def test_it_refuses_to_run_without_cuda(capsys):
    with pytest.raises(SystemExit):
        carve_algos.main(["--device", "cpu"])
    assert "needs a CUDA device" in capsys.readouterr().err
