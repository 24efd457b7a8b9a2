"""Lesson 07, model and tensor parallelism: layers split across ranks, from collectives and with DTensor."""
