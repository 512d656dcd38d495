"""Distillation losses and the distillation step."""
