"""Throughput accounting: model FLOPs per token and MFU only where a peak is known."""


def test_flops_per_token_and_mfu_peaks():
    import torch

    from accum_cli.metrics import flops_per_token, peak_flops

    # 1B params, 16 layers x 2048, seq 2048: 6e9 + 12*16*2048*2048
    assert flops_per_token(10**9, 16, 2048, 2048) == 6e9 + 805_306_368
    assert peak_flops(torch.device("cpu")) is None  # no MFU claimed on CPU
