"""Lesson 05, mixed precision: formats, underflow, loss scaling, AMP under DDP."""
