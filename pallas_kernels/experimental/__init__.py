"""Kernel variants that measured slower than the shipped ones (or were never timed), kept for reference and A/B runs.

No shipped configuration selects them by default; each module's docstring says in one line what it is for.

mxfp4_fp8_mma   MXFP4 codes decoded into e4m3 and multiplied on fp8 tensor cores (`MgpuConfig(mma="fp8")`):
                correct, slower than the bf16 decode on Hopper.
"""
