"""Images as prompts: decoding and preprocessing in the front (``processor``, ``sources``), the
pixel values of a step's image requests (``batch``) for a vision tower."""
