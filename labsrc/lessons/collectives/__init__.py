"""Lesson 02, collectives: send/recv and four collectives rank by rank, the ring checked against dist.all_reduce, the
lab, plots and exercises (the ring, its byte count and the timing sweep, which other lessons reuse: labsrc.techniques)."""
