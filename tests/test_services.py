"""The suite's own services are real: PostgreSQL answers SQL, SeaweedFS honours conditional puts."""

from __future__ import annotations

import boto3
import pytest
import sqlalchemy as sa
from botocore.exceptions import ClientError

from tests.services import S3Server


def test_postgres_is_real(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    with engine.connect() as conn:
        version = conn.execute(sa.text("select version()")).scalar_one()
    engine.dispose()
    assert "PostgreSQL" in version


def test_s3_honours_if_none_match(s3_credentials: S3Server) -> None:
    srv = s3_credentials
    client = boto3.client("s3", endpoint_url=srv.endpoint_url, region_name=srv.region)
    key = "services-check/if-none-match"
    client.put_object(Bucket=srv.bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as info:
        client.put_object(Bucket=srv.bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=srv.bucket, Key=key)["Body"].read() == b"first"
    client.delete_object(Bucket=srv.bucket, Key=key)
