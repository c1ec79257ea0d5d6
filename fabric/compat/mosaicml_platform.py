"""The environment variables by which Composer programs tell that they run on the MosaicML platform (Composer's
``composer.loggers.mosaicml_logger`` constants, which llm-foundry reads). Nothing here sets them: the platform is not
supported, so programs that look see that they are not on it."""

__all__ = ["MOSAICML_ACCESS_TOKEN_ENV_VAR", "MOSAICML_PLATFORM_ENV_VAR", "RUN_NAME_ENV_VAR"]

MOSAICML_PLATFORM_ENV_VAR = "MOSAICML_PLATFORM"
MOSAICML_ACCESS_TOKEN_ENV_VAR = "MOSAICML_ACCESS_TOKEN_FILE"
RUN_NAME_ENV_VAR = "RUN_NAME"
