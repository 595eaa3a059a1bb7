"""Speculative decoding: draft tokens proposed before a step (``ngram``), paced by each
request's acceptance (``pacing``), verified by the target model's logits (``verifier``)."""
