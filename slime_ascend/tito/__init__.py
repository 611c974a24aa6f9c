"""Token-in/token-out: the tokens trained on are the tokens sampled, with the same tokenizer."""
