"""Code several lessons use, kept once: collectives written from send/recv, the alpha-beta cost model."""
