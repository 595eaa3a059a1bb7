"""CLIP and SigLIP (two towers, one space) vs transformers, tiny random models, fp32: the image
preprocessing vs transformers' PIL image processors, each tower's hidden states, text and image
embeddings vs ``get_text_features`` / ``get_image_features`` and sentence-transformers, batch
invariance, score, and the
served shapes (vLLM's ``messages`` with ``image_url`` parts; Cohere's ``/v2/embed`` ``images`` and
``inputs`` through the ``cohere`` SDK) with their bad inputs."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import NUM_THREADS
from factories.vision import IMAGE_SIZE, TEXT, make_clip, make_image, make_siglip, png_bytes

from cenote import LLM
from cenote.errors import InvalidInputError
from cenote.forward_context import AttentionMetadata, forward_context
from cenote.images.processor import ImageProcessor
from cenote.models.clip import ClipModel
from cenote.models.config_reader import read_model_config
from cenote.models.loader import load_model

ATOL = 1e-4  # DESIGN.md §3: hidden states vs transformers, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
PIXEL_ATOL = 1e-5  # preprocessing vs transformers' image processor
TEXTS = ["a photo of a cat", "red square", "a blue circle of a dog dog dog", "cat"]
# (width, height): landscape, portrait, square, smaller than the crop, odd sizes
IMAGE_SHAPES = [(45, 37), (20, 50), (30, 30), (17, 13), (64, 31)]
PROCESSORS = {
    "clip": transformers.CLIPImageProcessorPil,
    "siglip": transformers.SiglipImageProcessorPil,
}


def _images() -> list:
    return [make_image(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SHAPES)]


@pytest.fixture(scope="module", params=["clip", "siglip"])
def family(request, tmp_path_factory: pytest.TempPathFactory):
    """(name, folder, transformers model, cenote LLM)."""
    folder = tmp_path_factory.mktemp(request.param)
    make = make_clip if request.param == "clip" else make_siglip
    hf = make(folder)
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    return request.param, folder, hf, llm


def _hf_pixels(name: str, folder: Path, images: list) -> torch.Tensor:
    processor = PROCESSORS[name].from_pretrained(folder)
    return processor(images=images, return_tensors="pt")["pixel_values"]


def _text_ids(name: str, tokenizer, text: str) -> torch.Tensor:
    """A text's ids as its model card feeds them: SigLIP's padded to the position limit (its
    ``padding="max_length"``, no attention mask), CLIP's as they are."""
    if name == "siglip":
        length = TEXT["max_position_embeddings"]
        return tokenizer(text, padding="max_length", max_length=length, return_tensors="pt")[
            "input_ids"
        ]
    return tokenizer(text, return_tensors="pt")["input_ids"]


def _embed(llm: LLM, prompts: list) -> torch.Tensor:
    outputs = llm.embed(prompts, use_tqdm=False)
    return torch.stack([torch.tensor(o.outputs.embedding) for o in outputs])


def test_preprocessing_matches_transformers(family) -> None:
    name, folder, _, _ = family
    images = _images() + [
        make_image(40, 33, seed=9).convert("RGBA"),
        make_image(33, 40).convert("L"),
    ]
    reference = _hf_pixels(name, folder, images)
    processor = ImageProcessor.from_folder(folder, IMAGE_SIZE)
    ours = torch.stack([processor(image) for image in images])
    assert ours.shape == reference.shape == (len(images), 3, IMAGE_SIZE, IMAGE_SIZE)
    torch.testing.assert_close(ours, reference, atol=PIXEL_ATOL, rtol=0)


def test_tower_hidden_states_match_transformers(family) -> None:
    name, folder, hf, _ = family
    model = load_model(read_model_config(folder, dtype="float32"))
    assert isinstance(model, ClipModel) and model.text_model and model.vision_model
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    flat = torch.tensor([t for row in ids for t in row])
    positions = torch.cat([torch.arange(len(row)) for row in ids])
    starts = [0]
    for row in ids:
        starts.append(starts[-1] + len(row))
    metadata = AttentionMetadata(
        query_start_loc=starts, seq_lens=[len(r) for r in ids], causal=False
    )
    pixels = _hf_pixels(name, folder, _images())
    with torch.no_grad(), forward_context(metadata):
        text_hidden = model.text_model(flat, positions)
        vision_hidden = model.vision_model(pixels)
        reference_vision = hf.vision_model(pixel_values=pixels).last_hidden_state
    for i, row in enumerate(ids):
        with torch.no_grad():
            reference = hf.text_model(input_ids=torch.tensor([row])).last_hidden_state[0]
        torch.testing.assert_close(
            text_hidden[starts[i] : starts[i + 1]], reference, atol=ATOL, rtol=0
        )
    if name == "siglip":  # transformers returns SigLIP's after the post-LayerNorm
        vision_hidden = model.vision_model.post_layernorm(vision_hidden)
    torch.testing.assert_close(vision_hidden, reference_vision, atol=ATOL, rtol=0)


def test_embeddings_match_transformers(family) -> None:
    """Texts and images in one call (they share steps): each as ``get_text_features`` /
    ``get_image_features``."""
    name, folder, hf, llm = family
    images = _images()
    ours = _embed(llm, [*TEXTS, *({"image": image} for image in images)])
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        text_reference = torch.cat(
            [
                hf.get_text_features(input_ids=_text_ids(name, tokenizer, t)).pooler_output
                for t in TEXTS
            ]
        )
        pixels = _hf_pixels(name, folder, images)
        image_reference = hf.get_image_features(pixel_values=pixels).pooler_output
    reference = torch.cat([text_reference, image_reference])
    cosine = F.cosine_similarity(ours, reference, dim=-1)
    assert cosine.min() >= MIN_COSINE_FP32, cosine
    torch.testing.assert_close(ours, F.normalize(reference, dim=-1), atol=1e-5, rtol=0)


def test_embeddings_match_sentence_transformers(family) -> None:
    """sentence-transformers 6 loads the same folder (its ``Transformer`` module calls the
    towers' feature methods; one call per modality) and agrees. SigLIP's texts are left out:
    sentence-transformers pads a batch to its longest text, so a text's embedding depends on its
    batch (SigLIP pools the last position, with no attention mask)."""
    from sentence_transformers import SentenceTransformer

    name, folder, _, llm = family
    st = SentenceTransformer(str(folder), device="cpu")
    images = _images()[:3]
    texts = TEXTS if name == "clip" else []
    reference = torch.cat(
        [
            *([st.encode(texts, convert_to_tensor=True)] if texts else []),
            st.encode(images, convert_to_tensor=True),
        ]
    ).float()
    ours = _embed(llm, [*texts, *({"image": image} for image in images)])
    cosine = F.cosine_similarity(ours, reference, dim=-1)
    assert cosine.min() >= MIN_COSINE_FP32, cosine
    if texts:  # score is sentence-transformers' similarity (cosine) of image and texts
        similarity = st.similarity(reference[len(texts) :][:1], reference[: len(texts)])[0]
        scores = llm.score({"image": images[0]}, texts, use_tqdm=False)
        assert [o.outputs.score for o in scores] == pytest.approx(similarity.tolist(), abs=1e-5)


def test_batch_invariance(family) -> None:
    _, _, _, llm = family
    image = make_image(45, 37)
    alone = _embed(llm, [{"image": image}])[0]
    text_alone = _embed(llm, [TEXTS[2]])[0]
    batch = _embed(llm, [TEXTS[0], {"image": make_image(20, 50)}, {"image": image}, TEXTS[2]])
    torch.testing.assert_close(batch[2], alone, atol=BATCH_ATOL, rtol=0)
    torch.testing.assert_close(batch[3], text_alone, atol=BATCH_ATOL, rtol=0)


def test_image_from_path_and_score(family, tmp_path: Path) -> None:
    """An image as a path embeds as the PIL image; ``score`` is the cosine of image and text
    embeddings (1 -> N)."""
    _, _, _, llm = family
    image = make_image(45, 37)
    path = tmp_path / "image.png"
    path.write_bytes(png_bytes(image))
    from_path, from_pil, *texts = _embed(llm, [{"image": str(path)}, {"image": image}, *TEXTS])
    torch.testing.assert_close(from_path, from_pil, atol=BATCH_ATOL, rtol=0)
    scores = [o.outputs.score for o in llm.score({"image": image}, TEXTS, use_tqdm=False)]
    expected = [float(F.cosine_similarity(from_pil, t, dim=0)) for t in texts]
    assert scores == pytest.approx(expected, abs=1e-5)


def test_score_matches_transformers_logits(family) -> None:
    """``score`` is the cosine of the two embeddings, as vLLM's and sentence-transformers'
    (``similarity``) are: transformers' ``logits_per_image`` without the model's scale (and
    SigLIP's bias), ``cosine = (logit - logit_bias) / exp(logit_scale)``. Image -> texts and
    text -> images."""
    name, folder, hf, llm = family
    images = _images()[:3]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    pixels = _hf_pixels(name, folder, images)
    with torch.no_grad():  # [num_images, num_texts]
        logits = torch.cat(
            [
                hf(input_ids=_text_ids(name, tokenizer, t), pixel_values=pixels).logits_per_image
                for t in TEXTS
            ],
            dim=1,
        )
        bias = hf.logit_bias if name == "siglip" else 0.0
        cosine = (logits - bias) / hf.logit_scale.exp()
    for i, image in enumerate(images):
        scores = llm.score({"image": image}, TEXTS, use_tqdm=False)
        assert [o.outputs.score for o in scores] == pytest.approx(cosine[i].tolist(), abs=1e-5)
    scores = llm.score(TEXTS[1], [{"image": image} for image in images], use_tqdm=False)
    assert [o.outputs.score for o in scores] == pytest.approx(cosine[:, 1].tolist(), abs=1e-5)


def test_offline_bad_images(family, tmp_path: Path) -> None:
    """Not an image, a missing file, a wrong type: clear errors, and the engine goes on."""
    _, _, _, llm = family
    not_image = tmp_path / "notes.png"
    not_image.write_text("this is not a picture")
    with pytest.raises(InvalidInputError, match="not an image"):
        llm.embed([{"image": str(not_image)}], use_tqdm=False)
    with pytest.raises(InvalidInputError, match="is not a file"):
        llm.embed([{"image": str(tmp_path / "missing.png")}], use_tqdm=False)
    with pytest.raises(InvalidInputError, match="PIL image, a path or a URL"):
        llm.embed([{"image": 42}], use_tqdm=False)
    with pytest.raises(InvalidInputError, match="token_embed. is not supported"):
        llm.encode([{"image": make_image(30, 30)}], pooling_task="token_embed", use_tqdm=False)
    assert len(_embed(llm, [{"image": make_image(30, 30)}, "cat"])) == 2


@pytest.mark.parametrize(
    "kind", ["CLIPTextModelWithProjection", "CLIPTextModel", "SiglipTextModel"]
)
def test_text_only_folder(tmp_path: Path, kind: str) -> None:
    """The text tower alone: texts as transformers embeds them (``text_embeds``;
    ``CLIPTextModel``'s and SigLIP's ``pooler_output``); an image is a clear error naming the
    missing tower."""
    hf = make_clip(tmp_path, kind) if kind.startswith("CLIP") else make_siglip(tmp_path, kind)
    llm = LLM(str(tmp_path), dtype="float32", num_threads=NUM_THREADS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        name = "clip" if kind.startswith("CLIP") else "siglip"
        outputs = [hf(input_ids=_text_ids(name, tokenizer, t)) for t in TEXTS]
    field = "text_embeds" if kind == "CLIPTextModelWithProjection" else "pooler_output"
    reference = torch.cat([getattr(o, field) for o in outputs])
    cosine = F.cosine_similarity(_embed(llm, TEXTS), reference, dim=-1)
    assert cosine.min() >= MIN_COSINE_FP32
    with pytest.raises(InvalidInputError, match=f"no vision tower .{kind} embeds texts only"):
        llm.embed([{"image": make_image(30, 30)}], use_tqdm=False)


@pytest.mark.parametrize(
    "kind", ["CLIPVisionModelWithProjection", "CLIPVisionModel", "SiglipVisionModel"]
)
def test_image_only_folder(tmp_path: Path, kind: str) -> None:
    """The vision tower alone, saved without a tokenizer: hidden states and image embeddings as
    transformers gives them (``image_embeds``; ``CLIPVisionModel``'s and SigLIP's
    ``pooler_output``), images scored against images; a text is a clear error naming what the
    folder has."""
    name = "clip" if kind.startswith("CLIP") else "siglip"
    hf = (make_clip if name == "clip" else make_siglip)(tmp_path, kind)
    assert not (tmp_path / "tokenizer.json").exists()
    images = _images()
    pixels = _hf_pixels(name, tmp_path, images)
    model = load_model(read_model_config(tmp_path, dtype="float32"))
    assert isinstance(model, ClipModel) and model.text_model is None and model.vision_model
    with torch.no_grad():
        hidden = model.vision_model(pixels)
        outputs = hf(pixel_values=pixels)
    if name == "siglip":  # transformers returns SigLIP's after the post-LayerNorm
        hidden = model.vision_model.post_layernorm(hidden)
    torch.testing.assert_close(hidden, outputs.last_hidden_state, atol=ATOL, rtol=0)
    with_projection = kind == "CLIPVisionModelWithProjection"
    reference = outputs.image_embeds if with_projection else outputs.pooler_output
    llm = LLM(str(tmp_path), dtype="float32", num_threads=NUM_THREADS)
    ours = _embed(llm, [{"image": image} for image in images])
    cosine = F.cosine_similarity(ours, reference, dim=-1)
    assert cosine.min() >= MIN_COSINE_FP32, cosine
    scores = llm.score({"image": images[0]}, [{"image": i} for i in images[1:]], use_tqdm=False)
    expected = F.cosine_similarity(reference[:1], reference[1:], dim=-1).tolist()
    assert [o.outputs.score for o in scores] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(InvalidInputError, match=f"{kind} is an image-only folder"):
        llm.embed(["a photo of a cat"], use_tqdm=False)
    with pytest.raises(InvalidInputError, match="image-only folder"):
        llm.score({"image": images[0]}, ["cat"], use_tqdm=False)
    assert len(_embed(llm, [{"image": images[0]}])) == 1  # the engine goes on


# ---- served: vLLM's messages with image_url parts ---------------------------------------------


def _data_uri(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def _image_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def clip_server(tmp_path_factory: pytest.TempPathFactory):
    """``cenote serve`` on a tiny CLIP, local media allowed under one folder, 2,000 pixels."""
    from tests.server_fixture import ServerProcess

    folder = tmp_path_factory.mktemp("clip_served")
    make_clip(folder)
    media = tmp_path_factory.mktemp("media")
    (media / "image.png").write_bytes(png_bytes(make_image(45, 37)))
    server = ServerProcess(
        str(folder), "--dtype", "float32", "--num-threads", str(NUM_THREADS),
        "--allowed-local-media-path", str(media), "--max-image-pixels", "2000",
    )  # fmt: skip
    try:
        yield server, folder, media
    finally:
        server.stop()


def test_served_image_embeddings(clip_server) -> None:
    """``/v1/embeddings`` and ``/pooling`` take an image as a data URI or an allowed file://
    path; image and text embeddings are those of the offline engine."""
    server, folder, media = clip_server
    image = make_image(45, 37)
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    expected_image, expected_text = _embed(llm, [{"image": image}, TEXTS[0]])
    url = f"{server.url}/v1/embeddings"
    for source in (_data_uri(image), f"file://{media / 'image.png'}"):
        response = httpx.post(url, json={"messages": _image_messages(source)}, timeout=60)
        assert response.status_code == 200, response.text
        got = torch.tensor(response.json()["data"][0]["embedding"])
        torch.testing.assert_close(got, expected_image, atol=BATCH_ATOL, rtol=0)
    response = httpx.post(url, json={"input": TEXTS[0]}, timeout=60)
    torch.testing.assert_close(
        torch.tensor(response.json()["data"][0]["embedding"]),
        expected_text,
        atol=BATCH_ATOL,
        rtol=0,
    )
    body = {"messages": _image_messages(_data_uri(image)), "task": "embed"}
    response = httpx.post(f"{server.url}/pooling", json=body, timeout=60)
    assert response.status_code == 200, response.text
    torch.testing.assert_close(
        torch.tensor(response.json()["data"][0]["data"]), expected_image, atol=BATCH_ATOL, rtol=0
    )


@pytest.mark.parametrize(
    "case",
    [
        "not_an_image",
        "too_many_pixels",
        "remote_url",
        "file_outside",
        "image_and_text",
        "bad_base64",
    ],
)
def test_served_bad_images(clip_server, tmp_path: Path, case: str) -> None:
    """Each is a 400 naming the cause (with the numbers), and the engine serves the next one."""
    server, _, media = clip_server
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes(make_image(30, 30)))
    messages, expected = {
        "not_an_image": (
            _image_messages("data:image/png;base64," + base64.b64encode(b"plain text").decode()),
            "not an image",
        ),
        "too_many_pixels": (
            _image_messages(_data_uri(make_image(50, 41))),
            "50 x 41 = 2050 pixels, more than the limit of 2000",
        ),
        "remote_url": (_image_messages("https://example.com/cat.png"), "--allow-remote-media"),
        "file_outside": (_image_messages(f"file://{outside}"), "outside the allowed local media"),
        "image_and_text": (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": _data_uri(make_image(9, 9))}},
                        {"type": "text", "text": "a cat"},
                    ],
                }
            ],
            "exactly one image_url part and no text",
        ),
        "bad_base64": (_image_messages("data:image/png;base64,@@@"), "not valid base64"),
    }[case]
    url = f"{server.url}/v1/embeddings"
    response = httpx.post(url, json={"messages": messages}, timeout=60)
    assert response.status_code == 400, response.text
    assert expected in response.json()["error"]["message"]
    good = httpx.post(
        url, json={"messages": _image_messages(_data_uri(make_image(30, 30)))}, timeout=60
    )
    assert good.status_code == 200, good.text


# ---- served scores: vLLM's multimodal score inputs ({"content": [parts]}) ---------------------


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_served_image_scores(clip_server) -> None:
    """/score, /v1/score and the rerank routes take images as vLLM sends them: a side is one
    ``{"content": [parts]}`` (each part an input) or a list of texts and ``{"content": [part]}``
    elements; scores are the offline engine's (cosines), rerank results return an image
    document as its ``multi_modal`` part."""
    server, folder, media = clip_server
    images = [make_image(45, 37), make_image(20, 50, seed=1)]
    uris = [_data_uri(image) for image in images]
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    image_vs_texts = [
        o.outputs.score for o in llm.score({"image": images[0]}, TEXTS[:3], use_tqdm=False)
    ]
    text_vs_images = [
        o.outputs.score
        for o in llm.score(TEXTS[0], [{"image": image} for image in images], use_tqdm=False)
    ]
    from_file = f"file://{media / 'image.png'}"  # the same pixels as images[0]
    bodies = [
        ({"data_1": {"content": [_image_part(uris[0])]}, "data_2": TEXTS[:3]}, image_vs_texts),
        ({"text_1": [{"content": [_image_part(from_file)]}], "text_2": TEXTS[:3]}, image_vs_texts),
        ({"queries": TEXTS[0], "documents": {"content": [_image_part(u) for u in uris]}},
         text_vs_images),
        ({"queries": {"content": [{"type": "text", "text": TEXTS[0]}]},
          "items": [{"content": [_image_part(uris[0])]}, {"content": [_image_part(uris[1])]}]},
         text_vs_images),
    ]  # fmt: skip
    for path in ("/score", "/v1/score"):
        for body, expected in bodies:
            response = httpx.post(server.url + path, json=body, timeout=60)
            assert response.status_code == 200, response.text
            got = [row["score"] for row in response.json()["data"]]
            assert got == pytest.approx(expected, abs=1e-5), body
    rerank = {"query": TEXTS[0], "documents": {"content": [_image_part(u) for u in uris]}}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        response = httpx.post(server.url + path, json={**rerank, "return_documents": True})
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        best = max(range(2), key=lambda i: text_vs_images[i])
        assert [r["index"] for r in results] == [best, 1 - best]
        assert results[0]["relevance_score"] == pytest.approx(text_vs_images[best], abs=1e-5)
        assert results[0]["document"] == {"multi_modal": _image_part(uris[best])}
    body = {
        "query": {"content": [_image_part(uris[0])]},
        "documents": [*TEXTS[:2], {"text": "cat"}],
    }
    response = httpx.post(server.url + "/v1/rerank", json=body, timeout=60)
    assert response.status_code == 200, response.text
    scores = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
    expected = [*image_vs_texts[:2], llm.score({"image": images[0]}, "cat")[0].outputs.score]
    assert [scores[i] for i in range(3)] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        "not_an_image",
        "too_many_pixels",
        "remote_url",
        "file_outside",
        "video_part",
        "two_parts_in_an_element",
    ],
)
@pytest.mark.parametrize("route", ["/score", "/v1/rerank"])
def test_served_bad_image_scores(clip_server, tmp_path: Path, route: str, case: str) -> None:
    """Bad images on the score and rerank routes: a 400 naming the cause, and the engine
    serves the next request."""
    server, _, _ = clip_server
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes(make_image(30, 30)))
    good = _image_part(_data_uri(make_image(30, 30)))
    not_image = "data:image/png;base64," + base64.b64encode(b"plain text").decode()
    content, expected = {
        "not_an_image": ({"content": [_image_part(not_image)]}, "not an image"),
        "too_many_pixels": (
            {"content": [_image_part(_data_uri(make_image(50, 41)))]},
            "50 x 41 = 2050 pixels, more than the limit of 2000",
        ),
        "remote_url": (
            {"content": [_image_part("https://example.com/cat.png")]},
            "--allow-remote-media",
        ),
        "file_outside": (
            {"content": [_image_part(f"file://{outside}")]},
            "outside the allowed local media",
        ),
        "video_part": (
            {"content": [{"type": "video_url", "video_url": {"url": "x"}}]},
            "'video_url' part",
        ),
        "two_parts_in_an_element": ([{"content": [good, good]}], "holds 2 content parts"),
    }[case]
    if route == "/score":
        body = {"data_1": "a photo of a cat", "data_2": content}
    else:
        body = {"query": "a photo of a cat", "documents": content}
    response = httpx.post(server.url + route, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert expected in response.json()["error"]["message"]
    fine = {"data_1": "cat", "data_2": {"content": [good]}} if route == "/score" else {
        "query": "cat", "documents": {"content": [good]}}  # fmt: skip
    response = httpx.post(server.url + route, json=fine, timeout=60)
    assert response.status_code == 200, response.text


def test_served_image_only_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``cenote serve`` on a vision-only folder (no tokenizer): images embed and score; a text
    on /v1/embeddings or /score is a 400 naming the folder's architecture, and the server
    goes on."""
    from tests.server_fixture import ServerProcess

    folder = tmp_path_factory.mktemp("clip_vision_served")
    make_clip(folder, "CLIPVisionModelWithProjection")
    images = [make_image(45, 37), make_image(20, 50, seed=1)]
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    expected = _embed(llm, [{"image": image} for image in images])
    server = ServerProcess(
        str(folder), "--dtype", "float32", "--num-threads", str(NUM_THREADS)
    )  # fmt: skip
    try:
        url = server.url
        response = httpx.post(
            f"{url}/v1/embeddings", json={"messages": _image_messages(_data_uri(images[0]))}
        )
        assert response.status_code == 200, response.text
        got = torch.tensor(response.json()["data"][0]["embedding"])
        torch.testing.assert_close(got, expected[0], atol=BATCH_ATOL, rtol=0)
        parts = [_image_part(_data_uri(image)) for image in images]
        for path, body in (
            ("/v1/embeddings", {"input": "a photo of a cat"}),
            ("/score", {"data_1": "a photo of a cat", "data_2": {"content": parts}}),
        ):
            response = httpx.post(url + path, json=body, timeout=60)
            assert response.status_code == 400, response.text
            message = response.json()["error"]["message"]
            assert "CLIPVisionModelWithProjection is an image-only folder" in message
        body = {"data_1": {"content": parts[:1]}, "data_2": {"content": parts}}
        response = httpx.post(f"{url}/score", json=body, timeout=60)
        assert response.status_code == 200, response.text
        scores = [row["score"] for row in response.json()["data"]]
        cosine = F.cosine_similarity(expected[:1], expected, dim=-1).tolist()
        assert scores == pytest.approx(cosine, abs=1e-5)
    finally:
        server.stop()


# ---- served on Cohere's /v2/embed: images and inputs ------------------------------------------

COHERE_TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]


@pytest.fixture(scope="module")
def cohere_client(clip_server):
    """The official ``cohere`` SDK's ``ClientV2`` on the CLIP server, and its model name."""
    import cohere

    server, _, _ = clip_server
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    return cohere.ClientV2(api_key="unused", base_url=server.url), name


def test_cohere_image_embeddings(clip_server, cohere_client) -> None:
    """``images`` (input_type image) and ``inputs`` (one image_url or text part each) through the
    SDK: an image's vector is ``/v1/embeddings``' for the same image (and transformers'
    ``get_image_features``), a text's is ``/v1/embeddings``' text; every embedding type is
    encoded from those floats; images are billed by count, not as tokens."""
    import cohere

    server, folder, media = clip_server
    co, model = cohere_client
    image = make_image(45, 37)  # the pixels of media / "image.png"
    url = f"{server.url}/v1/embeddings"
    served = httpx.post(url, json={"messages": _image_messages(_data_uri(image))}, timeout=60)
    expected_image = torch.tensor(served.json()["data"][0]["embedding"])
    served = httpx.post(url, json={"input": TEXTS[0]}, timeout=60)
    expected_text = torch.tensor(served.json()["data"][0]["embedding"])
    hf = transformers.CLIPModel.from_pretrained(folder).eval()
    with torch.no_grad():
        pixels = _hf_pixels("clip", folder, [image])
        reference = hf.get_image_features(pixel_values=pixels).pooler_output

    response = co.embed(
        model=model, input_type="image", images=[_data_uri(image)], embedding_types=COHERE_TYPES
    )
    floats = torch.tensor(response.embeddings.float_)
    torch.testing.assert_close(floats[0], expected_image, atol=BATCH_ATOL, rtol=0)
    assert F.cosine_similarity(floats, reference, dim=-1).min() >= MIN_COSINE_FP32
    decoded = torch.frombuffer(bytearray(base64.b64decode(response.embeddings.base64[0])),
                               dtype=torch.float32)  # fmt: skip
    assert torch.equal(decoded, floats[0])
    assert len(response.embeddings.binary[0]) == len(response.embeddings.ubinary[0]) == 3  # 24/8
    assert all(-128 <= v <= 127 for v in response.embeddings.int8[0])
    assert response.meta.billed_units.images == 1 and response.meta.billed_units.input_tokens == 0

    inputs = [
        cohere.EmbedInput(content=[cohere.TextEmbedContent(text=TEXTS[0])]),
        cohere.EmbedInput(
            content=[
                cohere.ImageUrlEmbedContent(
                    image_url=cohere.EmbedImageUrl(url=f"file://{media / 'image.png'}")
                )
            ]
        ),
    ]
    response = co.embed(model=model, input_type="search_document", inputs=inputs)
    text_vector, image_vector = torch.tensor(response.embeddings.float_)
    torch.testing.assert_close(text_vector, expected_text, atol=BATCH_ATOL, rtol=0)
    torch.testing.assert_close(image_vector, expected_image, atol=BATCH_ATOL, rtol=0)
    billed = response.meta.billed_units
    assert billed.images == 1 and billed.input_tokens == 2 + len(TEXTS[0].split())


@pytest.mark.parametrize(
    "case",
    [
        "not_an_image",
        "too_many_pixels",
        "remote_url",
        "file_outside",
        "text_and_image_in_one_input",
        "texts_as_image",
        "texts_and_images",
        "image_part_without_url",
    ],
)
def test_cohere_bad_images(clip_server, tmp_path: Path, case: str) -> None:
    """Each is a 400 naming the cause (with the numbers) under the limits /v1/embeddings holds
    images to, and the engine serves the next request."""
    server, _, _ = clip_server
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes(make_image(30, 30)))
    not_image = "data:image/png;base64," + base64.b64encode(b"plain text").decode()
    good = _image_part(_data_uri(make_image(9, 9)))
    body, expected = {
        "not_an_image": ({"images": [not_image]}, "not an image"),
        "too_many_pixels": (
            {"images": [_data_uri(make_image(50, 41))]},
            "50 x 41 = 2050 pixels, more than the limit of 2000",
        ),
        "remote_url": ({"images": ["https://example.com/cat.png"]}, "--allow-remote-media"),
        "file_outside": ({"images": [f"file://{outside}"]}, "outside the allowed local media"),
        "text_and_image_in_one_input": (
            {"inputs": [{"content": [good, {"type": "text", "text": "a cat"}]}]},
            "inputs[0] holds 2 content parts (1 text, 1 image_url)",
        ),
        "texts_as_image": ({"texts": ["a cat"]}, "input_type 'image' embeds images"),
        "texts_and_images": (
            {"texts": ["a cat"], "images": [good["image_url"]["url"]]},
            "exactly one of texts, images and inputs (got texts, images)",
        ),
        "image_part_without_url": (
            {"inputs": [{"content": [{"type": "image_url"}]}]},
            "inputs[0] is an image_url part without image_url",
        ),
    }[case]
    url = f"{server.url}/v2/embed"
    response = httpx.post(url, json={"input_type": "image", **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert expected in response.json()["error"]["message"]
    fine = {"input_type": "image", "images": [good["image_url"]["url"]]}
    assert httpx.post(url, json=fine, timeout=60).status_code == 200
