//! Variable-length verification (DeepInfer's `MTPVarlen`, walkthrough Pass 3 and Pass 4 Thread 5):
//! choose how many draft rows a decode step checks from per-draft acceptance confidences and a
//! measured step-cost curve, then give the rows to the most confident drafts.

#[derive(Debug, Clone, PartialEq)]
pub struct VarlenChoice {
    /// Rows in the step: one per request plus the chosen drafts.
    pub num_rows: u32,
    /// Drafts each request checks (a prefix of its drafts).
    pub num_drafts: Vec<u32>,
    /// Expected tokens per millisecond of the choice.
    pub tokens_per_ms: f64,
}

#[derive(Debug, Clone)]
pub struct MtpVarlen {
    /// (graph rows, step milliseconds), ascending by rows.
    step_cost_ms: Vec<(u32, f64)>,
    /// Added to every step.
    sampler_ms: f64,
}

impl MtpVarlen {
    pub fn new(mut step_cost_ms: Vec<(u32, f64)>, sampler_ms: f64) -> Result<Self, String> {
        if step_cost_ms.is_empty() {
            return Err("the step-cost curve is empty".into());
        }
        if step_cost_ms.iter().any(|&(rows, ms)| rows == 0 || !ms.is_finite() || ms <= 0.0) {
            return Err("step-cost entries need positive rows and milliseconds".into());
        }
        if !sampler_ms.is_finite() || sampler_ms < 0.0 {
            return Err(format!("sampler_ms must be finite and non-negative, got {sampler_ms}"));
        }
        step_cost_ms.sort_by_key(|&(rows, _)| rows);
        Ok(MtpVarlen { step_cost_ms, sampler_ms })
    }

    /// Milliseconds of a step with `num_rows` rows: the smallest measured graph that holds them.
    pub fn step_ms(&self, num_rows: u32) -> Option<f64> {
        let i = self.step_cost_ms.partition_point(|&(rows, _)| rows < num_rows);
        self.step_cost_ms.get(i).map(|&(_, ms)| ms + self.sampler_ms)
    }

    /// `confidences[r][j]` is the chance that draft j of request r and all before it pass, so each
    /// row is non-increasing. Every request keeps its own row, which always yields a token.
    pub fn choose(&self, confidences: &[Vec<f64>]) -> Result<VarlenChoice, String> {
        let num_requests = confidences.len() as u32;
        if self.step_ms(num_requests.max(1)).is_none() {
            return Err(format!("{num_requests} requests exceed the largest graph"));
        }
        // All drafts, most confident first; ties go to the lower request, then the earlier draft.
        let mut drafts: Vec<(f64, usize, usize)> = Vec::new();
        for (r, row) in confidences.iter().enumerate() {
            for (j, &c) in row.iter().enumerate() {
                if !(0.0..=1.0).contains(&c) {
                    return Err(format!("confidence {c} of request {r} draft {j} is not in [0, 1]"));
                }
                drafts.push((c, r, j));
            }
        }
        drafts.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut expected = num_requests as f64;
        let mut best_extra = 0;
        let mut best = expected / self.step_ms(num_requests.max(1)).expect("checked");
        for (k, &(c, _, _)) in drafts.iter().enumerate() {
            expected += c;
            let Some(ms) = self.step_ms(num_requests + k as u32 + 1) else { break };
            let rate = expected / ms;
            if rate > best {
                best = rate;
                best_extra = k + 1;
            }
        }
        let mut num_drafts = vec![0u32; confidences.len()];
        for &(_, r, _) in &drafts[..best_extra] {
            num_drafts[r] += 1;
        }
        Ok(VarlenChoice { num_rows: num_requests + best_extra as u32, num_drafts, tokens_per_ms: best })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wxyz() -> Vec<Vec<f64>> {
        vec![vec![0.95, 0.90, 0.80], vec![0.85, 0.60, 0.30], vec![0.50, 0.20, 0.10], vec![0.30, 0.10, 0.05]]
    }

    #[test]
    fn walkthrough_picks_eight_rows() {
        let varlen = MtpVarlen::new(vec![(4, 8.1), (8, 8.6), (16, 12.0)], 0.4).unwrap();
        let choice = varlen.choose(&wxyz()).unwrap();
        assert_eq!(choice.num_rows, 8);
        assert_eq!(choice.num_drafts, vec![3, 1, 0, 0]);
        assert!((choice.tokens_per_ms - 7.5 / 9.0).abs() < 1e-12);
    }

    #[test]
    fn a_cheap_sixteen_row_graph_checks_every_draft() {
        let varlen = MtpVarlen::new(vec![(4, 8.1), (8, 8.6), (16, 10.4)], 0.4).unwrap();
        let choice = varlen.choose(&wxyz()).unwrap();
        assert_eq!(choice.num_rows, 16);
        assert_eq!(choice.num_drafts, vec![3, 3, 3, 3]);
        assert!((choice.tokens_per_ms - 9.65 / 10.8).abs() < 1e-12);
    }

    #[test]
    fn rejects_bad_inputs() {
        assert!(MtpVarlen::new(vec![], 0.0).is_err());
        let varlen = MtpVarlen::new(vec![(2, 1.0)], 0.0).unwrap();
        assert!(varlen.choose(&[vec![1.5]]).is_err());
        assert!(varlen.choose(&[vec![], vec![], vec![]]).is_err());
    }
}
