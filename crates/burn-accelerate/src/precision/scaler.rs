//! torch's `GradScaler` rules for fp16 loss scaling.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// torch's `GradScaler`: dynamic loss scaling for fp16.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The current scale.
    pub scale: f64,
    /// Factor applied after `growth_interval` steps without overflow (torch: 2).
    pub growth_factor: f64,
    /// Factor applied after an overflow (torch: 0.5).
    pub backoff_factor: f64,
    /// Steps without overflow before the scale grows (torch: 2000).
    pub growth_interval: u64,
    /// Steps without overflow since the last change.
    pub growth_tracker: u64,
}

impl Default for LossScaler {
    fn default() -> Self {
        Self {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            growth_tracker: 0,
        }
    }
}

impl LossScaler {
    /// A scaler starting at `init_scale` with torch's other defaults.
    pub fn with_init_scale(init_scale: f64) -> Self {
        Self {
            scale: init_scale,
            ..Self::default()
        }
    }

    /// Records the outcome of a step (`found_inf`: some gradient was inf or NaN, and the step is skipped) and
    /// adjusts the scale as torch's `GradScaler.update` does. Returns whether the step is skipped.
    pub fn update(&mut self, found_inf: bool) -> bool {
        if found_inf {
            self.scale *= self.backoff_factor;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.growth_interval {
                self.scale *= self.growth_factor;
                self.growth_tracker = 0;
            }
        }
        found_inf
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        let ok = self.scale.is_finite()
            && self.scale > 0.0
            && self.growth_factor > 1.0
            && self.backoff_factor > 0.0
            && self.backoff_factor < 1.0
            && self.growth_interval > 0;
        if ok {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "loss scaler {self:?}: the scale must be finite and positive, growth_factor > 1, \
                 0 < backoff_factor < 1 and growth_interval > 0"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sequence torch's GradScaler produces (its `_amp_update_scale_` rules), with growth_interval 3.
    #[test]
    fn scaler_sequence_matches_torch() {
        let mut scaler = LossScaler {
            growth_interval: 3,
            ..LossScaler::default()
        };
        // finite/inf pattern -> (skipped, scale after update)
        let pattern = [
            (false, false, 65536.0),
            (true, true, 32768.0),
            (true, true, 16384.0),
            (false, false, 16384.0),
            (false, false, 16384.0),
            (false, false, 32768.0),
            (false, false, 32768.0),
            (true, true, 16384.0),
            (false, false, 16384.0),
        ];
        for (i, (inf, skipped, scale)) in pattern.into_iter().enumerate() {
            assert_eq!(scaler.update(inf), skipped, "step {i}");
            assert_eq!(scaler.scale, scale, "step {i}");
        }
        // Accelerate's test_optimizer: good, NaN, NaN, good -> skipped F, T, T, F.
        let mut scaler = LossScaler::default();
        let skipped: Vec<bool> = [false, true, true, false]
            .into_iter()
            .map(|f| scaler.update(f))
            .collect();
        assert_eq!(skipped, vec![false, true, true, false]);
        assert!(
            LossScaler {
                backoff_factor: 2.0,
                ..LossScaler::default()
            }
            .validate()
            .is_err()
        );
    }
}
