import sys, torch
from target_svc import quantization as Q
G = int(sys.argv[1])
def grouped(x2d, weight):
    m, k = x2d.shape
    g = G
    while k % g: g //= 2
    xf = x2d.float().reshape(m, k // g, g)
    amax = xf.abs().amax(-1)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(xf / s[..., None]).clamp(-127, 127)
    w = weight.qweight.double().reshape(weight.qweight.shape[0], k // g, g)
    parts = torch.einsum("mgk,ngk->mng", xq.double(), w).float()  # exact per group
    acc = (parts * s[:, None, :]).sum(-1)
    return acc * weight.scales.float()[None, :]
Q.w8a8_reference = grouped
from bench import quant_quality
quant_quality.main(["--quantize", "w8a8", "--num-prompts", "8", "--threads", "2", "--out-dir", f"/tmp/gq/{G}"])
