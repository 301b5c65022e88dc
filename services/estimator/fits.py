"""The estimator's batch-time fits: each instance's new batch samples (from Redis) fed to
its OnlineBatchTimeFitter, and every refit published for its worker to read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import msgspec

from services.estimator.instances import InstanceState
from shared.logging import get_logger
from shared.messages import encode
from shared.messages.worker import BatchTimeCalibration
from shared.scheduling.snapshot import BatchSample
from shared.store import Store

log = get_logger(component="estimator")
_SAMPLE_DECODER = msgspec.msgpack.Decoder(BatchSample)
CALIBRATION_TTL_S = 3600.0  # a published fit outlives estimator restarts this long
SAMPLES_PER_READ = 2048  # newest batch samples read per instance per fit interval


async def fit_batch_times(store: Store, instances: Mapping[str, InstanceState]) -> None:
    """Feed new batch samples to each instance's fitter; publish every refit."""
    for iid, state in list(instances.items()):
        new = await new_samples(store, state)
        if not new:
            continue
        # The fit (numpy, a few ms for thousands of samples) runs off the event loop;
        # only the fit loop touches the fitter.
        fit = await asyncio.to_thread(state.add_samples, new)
        if fit is None:
            continue
        cal = BatchTimeCalibration(
            feature_set=fit.model.feature_set,
            coefs=list(fit.model.coefs),
            mape=fit.mape_inliers,
            mape_all=fit.mape_all,
            num_samples=fit.num_samples,
            fitted_at_s=time.time(),
        )
        await store.write_calibration(iid, encode(cal), ttl_s=CALIBRATION_TTL_S)
        log.info(
            "batch_time_fitted",
            instance_id=iid,
            feature_set=cal.feature_set,
            mape=round(cal.mape, 4),
            mape_all=round(cal.mape_all, 4),
            num_samples=cal.num_samples,
            num_stalls=fit.num_stalls,
        )


async def new_samples(store: Store, state: InstanceState) -> list[BatchSample]:
    """Samples newer than the last one fed, oldest first: read newest-first in growing
    pages, decoding only until an already-seen one."""
    count = 64
    while True:
        raw = await store.read_samples(state.instance_id, count)
        new: list[BatchSample] = []
        for blob in reversed(raw):
            sample = _SAMPLE_DECODER.decode(blob)
            if sample.wall_time_s <= state.last_sample_time_s:
                return new[::-1]
            new.append(sample)
        if len(raw) < count or count >= SAMPLES_PER_READ:
            return new[::-1]
        count = min(SAMPLES_PER_READ, count * 4)
