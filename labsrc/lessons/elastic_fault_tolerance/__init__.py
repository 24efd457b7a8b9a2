"""Lesson 10, elastic and fault-tolerant training, and 10b, elastic membership (membership*)."""
