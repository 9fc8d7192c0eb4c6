"""The fast multipart path gives Starlette's answer on the plain shape and steps aside on anything else."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.requests import Request

from tafl.serving.multipart import parse_simple


def _encode(files=None, data=None) -> tuple[str, bytes]:
    req = httpx.Request("POST", "http://x/predict", files=files, data=data)
    return req.headers["content-type"], req.read()


def _starlette(ctype: str, body: bytes) -> tuple[dict[str, list[bytes]], dict[str, list[str]]]:
    async def run():
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}
        scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
                 "headers": [(b"content-type", ctype.encode())]}
        form = await Request(scope, receive).form(max_files=50, max_fields=50)
        files: dict[str, list[bytes]] = {}
        fields: dict[str, list[str]] = {}
        for k, v in form.multi_items():
            if isinstance(v, str):
                fields.setdefault(k, []).append(v)
            else:
                files.setdefault(k, []).append(await v.read())
        await form.close()
        return files, fields
    return asyncio.run(run())


BINARY = bytes(range(256)) * 8 + b"\r\n--not-the-boundary\r\n\r\n"  # CRLFs and dashes inside the payload


@pytest.mark.parametrize("files,data", [
    ({"file": ("x.png", BINARY, "image/png")}, None),
    ({"file": ("x.png", b"", "image/png")}, {"model": "derm-gtafl", "heatmap": "true"}),
    ([("file", ("a.dcm", BINARY, "application/dicom")), ("file", ("b.jpg", b"\xff\xd8jpeg", "image/jpeg"))],
     {"model": "m"}),
    ({"image": ("x.png", BINARY, "image/png")}, {"note": "ünïcode ✓"}),
    ({"file": ("semi;colon \"q\".png", b"abc", "image/png")}, None),
])
def test_fast_path_matches_starlette(files, data):
    ctype, body = _encode(files, data)
    simple = parse_simple(ctype, body)
    assert simple is not None, "httpx's encoding is the plain shape"
    assert (simple.files, simple.fields) == _starlette(ctype, body)


def test_curl_style_body_and_quoted_boundary():
    body = (b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="ct.dcm"\r\n'
            b'Content-Type: application/octet-stream\r\n\r\n\x00\x01DICM\r\n--XyZ\r\n'
            b'Content-Disposition: form-data; name="heatmap"\r\n\r\n1\r\n--XyZ--\r\n')
    for ctype in ("multipart/form-data; boundary=XyZ", 'multipart/form-data; boundary="XyZ"'):
        simple = parse_simple(ctype, body)
        assert simple is not None
        assert simple.files == {"file": [b"\x00\x01DICM"]} and simple.fields == {"heatmap": ["1"]}
        assert simple.names == ["file", "heatmap"]
        assert (simple.files, simple.fields) == _starlette(ctype, body)


@pytest.mark.parametrize("body", [
    b'preamble\r\n--B\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nx\r\n--B--\r\n',
    b'--B\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nx\r\n--B',  # not closed
    b'--B\r\nContent-Disposition: form-data; name="file"; filename="a"\r\nContent-Transfer-Encoding: base64\r\n'
    b'\r\neA==\r\n--B--\r\n',
    b'--B\r\nContent-Disposition: form-data; name="file"; filename*=UTF-8\'\'%C3%A9.png\r\n\r\nx\r\n--B--\r\n',
    b'--B\r\nContent-Disposition: form-data; name="fi\\"le"; filename="a"\r\n\r\nx\r\n--B--\r\n',
    b'--B\r\nContent-Disposition: attachment; name="file"\r\n\r\nx\r\n--B--\r\n',
    b'--B\r\nContent-Disposition: form-data; filename="a"\r\n\r\nx\r\n--B--\r\n',  # no name
    b'--B\r\nno headers here\r\n--B--\r\n',
    b'--B\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nx\r\n--B--\r\nepilogue',
    b'',
])
def test_anything_unusual_falls_back(body):
    assert parse_simple("multipart/form-data; boundary=B", body) is None


def test_limits_fall_back_to_the_full_parser():
    ctype, body = _encode([("file", ("a", b"x" * 100, "image/png"))] * 5)
    assert parse_simple(ctype, body, max_parts=4) is None
    assert parse_simple(ctype, body, max_part_bytes=99) is None
    assert len(parse_simple(ctype, body, max_parts=5, max_part_bytes=100).files["file"]) == 5
    assert parse_simple("multipart/form-data", body) is None  # no boundary
