"""Real services the tests start themselves (see hicached.testing)."""

from hicached.testing import CREDENTIALS, MooncakeMaster, S3Server, mooncake_master, s3_server

__all__ = ["CREDENTIALS", "MooncakeMaster", "S3Server", "mooncake_master", "s3_server"]
