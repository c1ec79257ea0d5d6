"""An S3 API server for tests: ``python s3_server.py ADDRESS BUCKET...``.

Starts moto's server on ADDRESS (an unused port), creates the buckets, prints the port on one line and
serves until its standard input closes (the test ends it by closing the pipe, or by a signal).
Run it inside a network namespace to serve the "nodes" of that namespace's veth pair.
"""

import os
import sys

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

import boto3
from moto.server import ThreadedMotoServer

address, buckets = sys.argv[1], sys.argv[2:]
server = ThreadedMotoServer(ip_address=address, port=0, verbose=False)
server.start()
port = server.get_host_and_port()[1]
client = boto3.client(
    "s3",
    endpoint_url=f"http://{address}:{port}",
    aws_access_key_id="testing",
    aws_secret_access_key="testing",
    region_name="us-east-1",
)
for bucket in buckets:
    client.create_bucket(Bucket=bucket)
print(port, flush=True)
sys.stdin.read()
server.stop()
