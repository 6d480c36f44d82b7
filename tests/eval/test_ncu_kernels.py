"""eval/ncu_kernels.py's parsing of Nsight Compute's CSV pages (ncu itself runs on the GPU machine only), and its
refusal without a GPU."""
import pytest
import torch

from qvg.eval import ncu_kernels

DETAILS = '''==PROF== Connected to process 1
"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"
"0","7","_pack_kernel","GPU Speed Of Light Throughput","Duration","ns","254,336"
"0","7","_pack_kernel","GPU Speed Of Light Throughput","DRAM Throughput","%","32.37"
"0","7","_pack_kernel","Compute Workload Analysis","Issue Slots Busy","%","76.83"
"0","7","_pack_kernel","Launch Statistics","Registers Per Thread","register/thread","127"
"1","7","_dequant_kernel","GPU Speed Of Light Throughput","Duration","ns","100,256"
'''
# the raw page's layout as ncu 2025 writes it: a units row, the NVTX range in a "Push/Pop_Range" column
RAW = '''"ID","thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg","Kernel Name","inst_executed","launch__occupancy_limit_registers","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__other.ratio"
"","","","inst","block","ratio","ratio","ratio"
"0","1250  ""<default domain>:compress qvg:none:none:none:none:none:none"" ","_pack_kernel","202,718,670","4","0.71","0.49","9"
"1","1250  ""<default domain>:dequant qvg:none:none:none:none:none:none"" ","_dequant_kernel","49,479,552","9","1.68","23.08","n/a"
'''


def test_summarize_reads_details_and_stalls():
    launches = ncu_kernels.summarize(DETAILS, RAW)
    assert [k["kernel"] for k in launches] == ["_pack_kernel", "_dequant_kernel"]
    pack, deq = launches
    assert pack["summary"]["duration"] == {"value": 254336.0, "unit": "ns"}
    assert pack["summary"]["issue_slots_busy_pct"] == 76.83 and pack["summary"]["registers_per_thread"] == 127.0
    assert "l2_throughput_pct" not in pack["summary"]  # absent metrics are left out, not invented
    assert (pack["call"], deq["call"]) == ("compress qvg", "dequant qvg")
    assert pack["raw"] == {"warp_instructions": 202718670.0, "blocks_per_sm_limit_registers": 4.0}
    assert pack["stalls_per_issue"] == {"wait": 0.71, "long_scoreboard": 0.49}
    assert list(deq["stalls_per_issue"]) == ["long_scoreboard", "wait"]  # sorted, largest first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_one_line_and_exit_2(capsys):
    assert ncu_kernels.main(["--out", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ncu_kernels: needs a CUDA GPU"]


@pytest.mark.parametrize("calls,says", [("compress,fft", "unknown kind 'fft'"), (",", "unknown kind ''")])
def test_bad_calls_one_line_and_exit_2(calls, says, capsys):
    """--calls is checked before anything else (the GPU included)."""
    assert ncu_kernels.main(["--calls", calls]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "known: compress, dequant, attention" in err[0]


def test_calls_parse():
    assert ncu_kernels.parse_calls("attention") == ["attention"]
    assert ncu_kernels.parse_calls("compress,dequant,attention") == list(ncu_kernels.CALLS)
