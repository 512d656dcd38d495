"""Language-model distillation: token-level losses over next-token distributions."""
