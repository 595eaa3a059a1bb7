"""The OpenAI Batch API, in OpenAI's shapes: ``POST /v1/files`` (multipart, purpose ``batch``),
``GET /v1/files``, ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE
/v1/files/{id}``; ``POST /v1/batches``, ``GET /v1/batches``, ``GET /v1/batches/{id}``, ``POST
/v1/batches/{id}/cancel``. On with ``--batch-dir`` (``server/batch_jobs.py`` runs the jobs,
``batch/store.py`` keeps them); without it each route is a 404 saying so.

An upload is bounded by ``--max-batch-file-bytes`` (413) and ``--max-batch-lines`` (400); its
lines are read when the batch runs, and a line that is not a valid request gets its error on
its own line of the error file while the others run.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel

from cenote.server.batch_jobs import BatchJobs
from cenote.server.batch_lines import BODY_MODELS
from cenote.server.batch_store import BatchStatus, StoredFile
from cenote.server.body import JSONRoute
from cenote.server.errors import BadRequest, Conflict, ModelNotFound, error_responses
from cenote.server.protocol import _Body
from cenote.server.responses import schema
from cenote.server.uploads import boundary_of, read_upload

router = APIRouter(route_class=JSONRoute)
MULTIPART_SLACK_BYTES = 64 << 10  # form framing an upload body may add to its file's bound
_MAX_METADATA_PAIRS, _MAX_METADATA_KEY, _MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds


class CreateBatchRequest(_Body):
    """POST /v1/batches (OpenAI's body)."""

    input_file_id: str  # an uploaded file of purpose "batch"
    endpoint: str  # the url of every line: /v1/embeddings, /v1/chat/completions, ...
    completion_window: str  # "24h"
    metadata: dict[str, str] | None = None  # up to 16 pairs, echoed on the batch


# ---- the answers, as OpenAI documents them (the OpenAPI document's schemas) --------------------


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int  # unix seconds
    expires_at: int | None
    filename: str
    purpose: str  # "batch" (uploaded) or "batch_output" (a batch's output or error file)
    status: Literal["processed"]
    status_details: str | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchError(BaseModel):
    code: str  # duplicate_custom_id, missing_file, internal_error
    message: str
    param: str | None
    line: int | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int  # lines of the input file
    completed: int  # lines answered 200
    failed: int  # lines with an error


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None  # why a failed batch failed
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None  # the successful lines, in input order
    error_file_id: str | None  # the failed lines, in input order
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


def _jobs(raw_request: Request) -> BatchJobs:
    jobs: BatchJobs | None = raw_request.app.state.batch_jobs
    if jobs is None:
        raise ModelNotFound(
            "the Batch API is off on this server: start cenote serve with --batch-dir DIR to "
            "keep files and batches there"
        )
    return jobs


async def _file(jobs: BatchJobs, file_id: str) -> StoredFile:
    stored = await jobs.db(jobs.store.get_file, file_id)
    if stored is None:
        raise ModelNotFound(f"no file with id {file_id!r:.100}", param="file_id")
    return stored


# ---- files ------------------------------------------------------------------------------------


_UPLOAD_FORM = {"type": "object", "required": ["file", "purpose"], "properties": {
    "file": {"type": "string", "format": "binary"}, "purpose": {"type": "string", "enum": ["batch"]},
}}  # fmt: skip


@router.post(
    "/v1/files",
    responses=schema(FileObject, 400, 401, 404, 413, 503),
    openapi_extra={"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": _UPLOAD_FORM}}}},
)  # fmt: skip
async def create_file(raw_request: Request) -> JSONResponse:
    """A multipart form of ``purpose`` ("batch") and ``file`` (JSONL, one request a line)."""
    jobs = _jobs(raw_request)
    options = raw_request.app.state.cenote.options
    boundary = boundary_of(raw_request.headers.get("content-type", ""))
    path = jobs.store.new_upload_path()
    try:
        upload = await read_upload(
            raw_request.stream(), boundary, path, options.max_batch_file_bytes,
            options.max_batch_lines,
        )  # fmt: skip
        purpose = upload.fields.get("purpose")
        if purpose != "batch":
            raise BadRequest(
                f"purpose must be 'batch' (the only files this server keeps), got {purpose!r:.40}",
                param="purpose",
            )
        if upload.filename is None:
            raise BadRequest("the form has no 'file' part", param="file")
        if upload.num_bytes == 0:
            raise BadRequest("the file is empty; a batch file holds one request a line", "file")
        stored = await jobs.db(
            jobs.store.add_file, path, purpose, upload.filename, upload.num_bytes,
            upload.num_lines,
        )  # fmt: skip
    finally:
        path.unlink(missing_ok=True)  # moved into the store, or refused
    return JSONResponse(stored.to_openai())


@router.get("/v1/files", responses=schema(FileList, 401, 404))
async def list_files(raw_request: Request) -> JSONResponse:
    jobs = _jobs(raw_request)
    files = await jobs.db(jobs.store.list_files)
    return JSONResponse(
        {"object": "list", "data": [f.to_openai() for f in files], "has_more": False}
    )


@router.get("/v1/files/{file_id}", responses=schema(FileObject, 401, 404))
async def retrieve_file(file_id: str, raw_request: Request) -> JSONResponse:
    jobs = _jobs(raw_request)
    return JSONResponse((await _file(jobs, file_id)).to_openai())


@router.get(
    "/v1/files/{file_id}/content",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "The file"},
               **error_responses(401, 404)},
)  # fmt: skip
async def file_content(file_id: str, raw_request: Request) -> FileResponse:
    jobs = _jobs(raw_request)
    stored = await _file(jobs, file_id)
    return FileResponse(
        jobs.store.file_path(stored.id), media_type="application/octet-stream",
        filename=stored.filename,
    )  # fmt: skip


@router.delete("/v1/files/{file_id}", responses=schema(FileDeleted, 401, 404, 409))
async def delete_file(file_id: str, raw_request: Request) -> JSONResponse:
    jobs = _jobs(raw_request)
    await _file(jobs, file_id)
    batch_id = await jobs.db(jobs.store.file_in_use, file_id)
    if batch_id is not None:
        raise Conflict(
            f"the file {file_id} is the input of batch {batch_id}, which has not finished; "
            "cancel it first",
            param="file_id",
        )
    await jobs.db(jobs.store.delete_file, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# ---- batches ----------------------------------------------------------------------------------


@router.post("/v1/batches", responses=schema(BatchObject, 400, 401, 404, 413, 503))
async def create_batch(body: CreateBatchRequest, raw_request: Request) -> JSONResponse:
    jobs = _jobs(raw_request)
    if body.endpoint not in BODY_MODELS:
        raise BadRequest(
            f"endpoint {body.endpoint!r:.100} is not served in batches; choose among "
            f"{', '.join(BODY_MODELS)}",
            param="endpoint",
        )
    if body.completion_window != "24h":
        raise BadRequest(
            f"completion_window must be '24h', got {body.completion_window!r:.40}",
            param="completion_window",
        )
    _check_metadata(body.metadata)
    stored = await _file(jobs, body.input_file_id)
    if stored.purpose != "batch":
        raise BadRequest(
            f"the file {stored.id} has purpose {stored.purpose!r}; a batch reads a file "
            "uploaded with purpose 'batch'",
            param="input_file_id",
        )
    batch_id = await jobs.db(jobs.store.add_batch, body.endpoint, stored, body.metadata)
    jobs.wake()
    return JSONResponse(await jobs.db(jobs.store.to_openai, batch_id))


@router.get("/v1/batches", responses=schema(BatchList, 400, 401, 404))
async def list_batches(
    raw_request: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JSONResponse:
    """Newest first; ``after`` (a batch id) pages on."""
    jobs = _jobs(raw_request)
    data, has_more = await jobs.db(jobs.store.list_batches, after, limit)
    return JSONResponse({
        "object": "list", "data": data, "has_more": has_more,
        "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
    })  # fmt: skip


@router.get("/v1/batches/{batch_id}", responses=schema(BatchObject, 401, 404))
async def retrieve_batch(batch_id: str, raw_request: Request) -> JSONResponse:
    jobs = _jobs(raw_request)
    return JSONResponse(await _batch(jobs, batch_id))


@router.post(
    "/v1/batches/{batch_id}/cancel", responses=schema(BatchObject, 400, 401, 404, 409, 413, 503)
)
async def cancel_batch(batch_id: str, raw_request: Request) -> JSONResponse:
    """A validating or running batch becomes cancelling, then cancelled with the lines that
    finished in its output file."""
    jobs = _jobs(raw_request)
    await _batch(jobs, batch_id)
    if not await jobs.cancel(batch_id):
        status = (await _batch(jobs, batch_id))["status"]
        raise Conflict(
            f"batch {batch_id} is {status}; only a validating or in-progress batch can be cancelled"
        )
    return JSONResponse(await _batch(jobs, batch_id))


async def _batch(jobs: BatchJobs, batch_id: str) -> dict[str, Any]:
    body = await jobs.db(jobs.store.to_openai, batch_id)
    if body is None:
        raise ModelNotFound(f"no batch with id {batch_id!r:.100}", param="batch_id")
    return body


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > _MAX_METADATA_PAIRS:
        raise BadRequest(
            f"metadata has {len(metadata)} pairs, at most {_MAX_METADATA_PAIRS}", "metadata"
        )
    for key, value in metadata.items():
        if len(key) > _MAX_METADATA_KEY or len(value) > _MAX_METADATA_VALUE:
            raise BadRequest(
                f"metadata key {key[:70]!r} or its value is too long (keys at most "
                f"{_MAX_METADATA_KEY} characters, values {_MAX_METADATA_VALUE})",
                param="metadata",
            )
