"""Lesson 09, memory and sharding: where the bytes go, ZeRO 1-3 and FSDP2 by hand and torch's own."""
