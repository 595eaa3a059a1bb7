import torch
import torch.nn.functional as F

from tests.conftest import HfRunner


class EncoderScoringHfRunner(HfRunner):
    """Bi-encoder scores: cosine of the two texts' sentence embeddings."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, is_sentence_transformer=True)

    @torch.inference_mode()
    def predict(self, prompts, *args, **kwargs):
        pairs = [self.encode(prompt) for prompt in prompts]
        return torch.as_tensor(
            [F.cosine_similarity(*map(torch.tensor, pair), dim=0) for pair in pairs]
        )
