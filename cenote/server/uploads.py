"""A ``multipart/form-data`` body read as it arrives (``POST /v1/files``): the ``file`` part is
written straight to disk, bounded in bytes and lines, the other fields kept (at most 1 KiB
each). Only what an upload needs, so the server takes no multipart dependency: parts with
Content-Disposition ``form-data`` and a ``name``, no nested multipart."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path

from cenote.server.errors import BadRequest, PayloadTooLarge

_MAX_HEADER_BYTES = 16 << 10  # the headers of one part
_MAX_FIELD_BYTES = 1 << 10  # a form field that is not the file (purpose)


@dataclass
class Upload:
    """What ``read_upload`` found: the form's fields, and the file's name, size and lines."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # None: no ``file`` part
    num_bytes: int = 0
    num_lines: int = 0  # newlines, plus one for a last line without its newline


def boundary_of(content_type: str) -> bytes:
    message = Message()
    message["content-type"] = content_type
    boundary = message.get_param("boundary")
    if message.get_content_type() != "multipart/form-data" or not isinstance(boundary, str):
        raise BadRequest(
            f"upload the file as multipart/form-data (fields 'file' and 'purpose'); got "
            f"Content-Type {content_type[:100]!r}"
        )
    return boundary.encode("latin-1")


async def read_upload(
    chunks: AsyncIterator[bytes], boundary: bytes, path: Path, max_bytes: int, max_lines: int
) -> Upload:
    """Read the form; the ``file`` part goes to ``path``. 413 past ``max_bytes``, 400 past
    ``max_lines`` or for a body that is not the multipart it says."""
    upload = Upload()
    delimiter = b"\r\n--" + boundary
    buffer = b"\r\n"  # so the first boundary matches the delimiter too
    state, name, value = "preamble", "", bytearray()
    last_byte = b"\n"
    with open(path, "wb") as out:
        stream = aiter(chunks)
        done = False
        while not done:
            # 1) the part's boundary, then its headers, then its content until the next one
            if state == "preamble" or state == "content":
                index = buffer.find(delimiter)
                keep = len(buffer) - len(delimiter) + 1 if index < 0 else index
                if state == "content" and keep > 0:
                    piece = buffer[:keep]
                    if name == "file":
                        upload.num_bytes += len(piece)
                        upload.num_lines += piece.count(b"\n")
                        _check_bounds(upload, max_bytes, max_lines)
                        out.write(piece)
                        last_byte = piece[-1:]
                    else:
                        value += piece
                        if len(value) > _MAX_FIELD_BYTES:
                            raise BadRequest(f"the form field {name!r} exceeds 1 KiB")
                if index >= 0:
                    if state == "content" and name != "file":
                        upload.fields[name] = value.decode("utf-8", "replace")
                    buffer, state = buffer[index + len(delimiter) :], "after_boundary"
                    continue
                buffer = buffer[max(keep, 0) :]
            elif state == "after_boundary" and len(buffer) >= 2:
                if buffer.startswith(b"--"):
                    done = True
                    continue
                end = buffer.find(b"\r\n")
                if end >= 0:
                    buffer, state = buffer[end + 2 :], "headers"
                    continue
                if len(buffer) > _MAX_HEADER_BYTES:
                    raise BadRequest("the multipart body has no line end after a boundary")
            elif state == "headers":
                end = buffer.find(b"\r\n\r\n")
                if end >= 0:
                    name = _part_name(buffer[:end], upload)
                    buffer, state, value = buffer[end + 4 :], "content", bytearray()
                    continue
                if len(buffer) > _MAX_HEADER_BYTES:
                    raise BadRequest("a part of the form has more than 16 KiB of headers")
            # 2) more of the body
            chunk = await anext(stream, None)
            if chunk is None:
                raise BadRequest("the multipart body ends before its closing boundary")
            buffer += chunk
    if upload.num_bytes and last_byte != b"\n":
        upload.num_lines += 1
    return upload


def _check_bounds(upload: Upload, max_bytes: int, max_lines: int) -> None:
    if upload.num_bytes > max_bytes:
        raise PayloadTooLarge(
            f"the file exceeds the limit of {max_bytes} bytes (--max-batch-file-bytes)"
        )
    if upload.num_lines > max_lines:
        raise BadRequest(
            f"the file has more than {max_lines} lines, the limit per batch (--max-batch-lines)",
            param="file",
        )


def _part_name(raw: bytes, upload: Upload) -> str:
    """The part's field name (its file name noted on ``upload`` for the ``file`` field)."""
    message = Message()
    for line in raw.decode("utf-8", "replace").split("\r\n"):
        key, sep, value = line.partition(":")
        if sep:
            message[key.strip()] = value.strip()
    name = message.get_param("name", header="content-disposition")
    if not isinstance(name, str):
        raise BadRequest("a part of the form has no Content-Disposition name")
    if name == "file":
        if upload.filename is not None:
            raise BadRequest("the form holds two 'file' parts; upload one file at a time")
        filename = message.get_param("filename", header="content-disposition")
        upload.filename = filename if isinstance(filename, str) and filename else "upload.jsonl"
    return name
