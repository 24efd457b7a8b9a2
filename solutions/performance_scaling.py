"""Reference solutions of notebook 06's exercises (a step predicted for n GPUs; ring against tree; GPUs at 80%)."""
import math


def predict_step_time(compute_s, gradient_bytes, n, link, overlap):
    """compute + a ring all-reduce of the gradients over per-message `link`, minus the part hidden by overlap."""
    communication = 2 * (n - 1) * (link.alpha_s + gradient_bytes / n * link.beta_s_per_byte) if n > 1 else 0.0
    return compute_s + communication - overlap * min(compute_s, communication)


def ring_vs_tree(nbytes, n, link):
    """{"ring": s, "tree": s} for an all-reduce of nbytes over n ranks, every hop over `link`."""
    if n <= 1:
        return {"ring": 0.0, "tree": 0.0}
    ring = 2 * (n - 1) * (link.alpha_s + nbytes / n * link.beta_s_per_byte)
    tree = 2 * math.ceil(math.log2(n)) * link.alpha_s + 2 * nbytes * link.beta_s_per_byte
    return {"ring": ring, "tree": tree}


def largest_world(compute_s, gradient_bytes, link, efficiency):
    """The largest n up to 4096 whose compute / step (one ring, no overlap) is at least `efficiency`."""
    largest = 1
    for n in range(2, 4097):
        if compute_s / predict_step_time(compute_s, gradient_bytes, n, link, 0.0) >= efficiency:
            largest = n
    return largest
