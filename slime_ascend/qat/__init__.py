"""Quantisation-aware training on the one quantiser: the ``qat`` plugin (:mod:`.plugin`), its spec and layout checks
(:mod:`.spec`) and the train-side fake quant of Megatron's linear weights (:mod:`.modules`)."""
